"""Live weight updates against a real server: revisions published from a trainer, pinned, watched and
pulled in place, only what changed; storage revisions (files rewritten under the root) too; and the
hostile cases (no publish rights, another layout, oversized chunks, concurrent publishers, a
publisher gone midway, an evicted revision)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from tests.support.s3_stores import REGION, S3_BUCKET, S3Process, s3_settings
from tests.support.servers import eventually, loopback_settings, serving
from weightstream.client import (
    AbortedError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    WeightStreamClient,
)
from weightstream.protocol import wire
from weightstream.samples import ParameterTree
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server import WeightStreamServer
from weightstream_server.storage.index import INDEX_FILE

MODEL = "live"
# 10 tensors of 1 MiB and 2 of 4 MiB (float32).
SHAPES = {f"layers.{i}.weight": (256, 1024) for i in range(10)} | {
    "embed.weight": (1024, 1024),
    "head.weight": (1024, 1024),
}


def state_of(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def changed(state: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    new = {name: tensor.clone() for name, tensor in state.items()}
    for name in names:
        new[name] = torch.randn(new[name].shape, generator=generator)
    return new


def module_of(state: dict[str, torch.Tensor]) -> ParameterTree:
    return ParameterTree({name: (tuple(t.shape), t.dtype) for name, t in state.items()})


def assert_holds(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    got = dict(module.named_parameters())
    for name, tensor in state.items():
        assert torch.equal(got[name], tensor), name


def nbytes(state: dict[str, torch.Tensor], names: list[str]) -> int:
    return sum(state[n].numel() * state[n].element_size() for n in names)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / MODEL).mkdir()
    save_file(state_of(0), str(tmp_path / MODEL / "model.safetensors"))
    return tmp_path


@pytest.fixture
def server(root: Path) -> Iterator[WeightStreamServer]:
    with serving(loopback_settings(model_root=root, allow_publish=True, watch_interval=0.2)) as s:
        yield s


def client_of(server: WeightStreamServer, **options: object) -> WeightStreamClient:
    return WeightStreamClient(f"127.0.0.1:{server.port}", progress=False, transport="grpc", **options)  # type: ignore[arg-type]


def served(server: WeightStreamServer) -> int:
    return server.stats.snapshot().bytes_served_total


def test_a_published_revision_is_pulled_in_place_and_only_what_changed_travels(server: WeightStreamServer) -> None:
    a = state_of(0)
    names = ["layers.3.weight", "embed.weight"]
    b = changed(a, names, seed=1)
    module = module_of(a)
    with client_of(server) as client:
        first = client.load_into(module, MODEL)
        assert_holds(module, a)
        revision_b = client.publish(MODEL, b)
        assert revision_b.startswith("pub-") and revision_b != first.revision
        assert client.manifest(MODEL).revision == revision_b
        before, read = served(server), server.stats.snapshot().storage_bytes_read_total
        report = client.update_into(module, MODEL, since=first.revision)
        sent = served(server) - before
        assert server.stats.snapshot().storage_bytes_read_total == read, "a published revision is served from memory"
    assert_holds(module, b)
    assert report.revision == revision_b
    assert report.tensors == len(names)
    assert report.bytes == nbytes(b, names)
    assert nbytes(b, names) <= sent <= 1.1 * nbytes(b, names), sent


def test_only_the_changed_blocks_of_a_tensor_travel(server: WeightStreamServer) -> None:
    a = state_of(0)
    b = {name: t.clone() for name, t in a.items()}
    b["embed.weight"][300:310] += 1.0  # 40 KB inside one 1 MiB block of a 4 MiB tensor
    module = module_of(a)
    with client_of(server) as client:
        since = client.load_into(module, MODEL).revision
        client.publish(MODEL, b)
        changes = client.changes(MODEL, since=since)
        assert list(changes.tensors) == ["embed.weight"]
        assert changes.tensors["embed.weight"] == [(1024 * 1024, 2 * 1024 * 1024)]
        before = served(server)
        report = client.update_into(module, MODEL, since=since)
        sent = served(server) - before
    assert_holds(module, b)
    assert report.bytes == sent == 1024 * 1024


def test_revisions_are_pinned_watched_and_evicted(server: WeightStreamServer) -> None:
    a = state_of(0)
    with client_of(server) as client:
        revision_a = client.manifest(MODEL).revision
        events = client.watch(MODEL)
        assert next(events).revision == revision_a
        seen: list[str] = []
        watcher = threading.Thread(target=lambda: seen.extend(next(events).revision for _ in range(2)))
        watcher.start()
        b = changed(a, ["head.weight"], seed=2)
        revision_b = client.publish(MODEL, b, revision="step-1")
        c = changed(b, ["head.weight"], seed=3)
        revision_c = client.publish(MODEL, c, revision="step-2")
        watcher.join(timeout=10)
        assert seen == ["step-1", "step-2"]
        assert (revision_b, revision_c) == ("step-1", "step-2")
        # Kept: the current and the previous one; each is served as it was (and storage's, whose files are there).
        assert client.manifest(MODEL, revision="step-1").revision == "step-1"
        assert client.manifest(MODEL, revision=revision_a).revision == revision_a
        held = module_of(b)
        with torch.no_grad():
            for name, parameter in held.named_parameters():
                parameter.copy_(b[name])
        report = client.update_into(held, MODEL, since="step-1", revision="step-2")
        assert_holds(held, c)
        assert report.revision == "step-2"
        client.publish(MODEL, b, revision="step-3")
        with pytest.raises(NotFoundError, match=r"'step-1' is not kept here \(kept: step-2, step-3\)"):
            client.manifest(MODEL, revision="step-1")
        events.close()


def test_a_storage_revision_is_seen_by_a_watch_and_pulled_by_its_changed_blocks(
    root: Path, server: WeightStreamServer
) -> None:
    a = state_of(0)
    module = module_of(a)
    with client_of(server) as client:
        since = client.load_into(module, MODEL).revision
        events = client.watch(MODEL)
        assert next(events).revision == since  # the server follows the model: it digests each revision
        deadline = time.monotonic() + 10
        while server_digested(server) < sum(t.numel() * 4 for t in a.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        b = changed(a, ["layers.5.weight"], seed=4)
        staged = root / MODEL / "model.safetensors.tmp"
        save_file(b, str(staged))
        staged.replace(root / MODEL / "model.safetensors")
        event = next(events)
        assert event.origin == "storage" and event.revision != since
        events.close()
        before = served(server)
        report = client.update_into(module, MODEL, since=since)
        sent = served(server) - before
    assert_holds(module, b)
    assert report.revision == event.revision
    assert sent == nbytes(b, ["layers.5.weight"])


def server_digested(server: WeightStreamServer) -> int:
    changes = server.changes
    assert changes is not None
    return changes.bytes_digested


def test_publishing_needs_the_servers_consent(root: Path, tmp_path: Path) -> None:
    b = changed(state_of(0), ["head.weight"], seed=5)
    with serving(loopback_settings(model_root=root)) as plain, client_of(plain) as client:
        with pytest.raises(PermissionDeniedError, match="--allow-publish or --publish-token-file"):
            client.publish(MODEL, b)
        assert client.manifest(MODEL).revision != "refused"
    readers, publishers = tmp_path / "readers", tmp_path / "publishers"
    readers.write_text("read-token\n")
    publishers.write_text("publish-token\n")
    settings = loopback_settings(model_root=root, token_file=readers, publish_token_file=publishers)
    with serving(settings) as guarded:
        with client_of(guarded, token="read-token") as reader:
            revision_a = reader.manifest(MODEL).revision
            with pytest.raises(PermissionDeniedError, match="--publish-token-file"):
                reader.publish(MODEL, b)
            assert reader.manifest(MODEL).revision == revision_a
        with client_of(guarded, token="publish-token") as publisher:
            revision_b = publisher.publish(MODEL, b)
        with client_of(guarded, token="read-token") as reader:
            assert reader.manifest(MODEL).revision == revision_b


def test_a_publish_of_another_layout_is_refused_naming_the_tensor(server: WeightStreamServer) -> None:
    a = state_of(0)
    with client_of(server) as client:
        current = client.manifest(MODEL).revision
        wrong_shape = dict(a) | {"layers.7.weight": torch.zeros(256, 1000)}
        with pytest.raises(InvalidArgumentError, match=r"layers\.7\.weight"):
            client.publish(MODEL, wrong_shape)
        fewer = {n: t for n, t in a.items() if n != "head.weight"}
        with pytest.raises(InvalidArgumentError, match=r"head\.weight"):
            client.publish(MODEL, fewer)
        assert client.manifest(MODEL).revision == current
        renamed = client.publish(MODEL, fewer, new_layout=True)
        assert "head.weight" not in client.manifest(MODEL, revision=renamed)


def raw_stub(server: WeightStreamServer) -> tuple[grpc.Channel, pb_grpc.WeightStreamServiceStub]:
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    return channel, pb_grpc.WeightStreamServiceStub(channel)


def start_of(state: dict[str, torch.Tensor], revision: str = "") -> pb.PublishRequest:
    start = pb.PublishStart(model=MODEL, revision=revision)
    for name, tensor in state.items():
        start.tensors.append(pb.PublishedTensor(name=name, dtype=pb.DATA_TYPE_FLOAT32, shape=list(tensor.shape)))
    return pb.PublishRequest(start=start)


def chunk_of(name: str, offset: int, data: bytes) -> pb.PublishRequest:
    chunk = pb.TensorChunk(tensor=name, offset=offset, length=len(data), crc32c=wire.crc32c(data), data=data)
    return pb.PublishRequest(chunks=[chunk])


def test_a_chunk_beyond_its_tensor_or_with_a_bad_crc_ends_the_publish(server: WeightStreamServer) -> None:
    a = state_of(0)
    channel, stub = raw_stub(server)
    with channel, client_of(server) as client:
        current = client.manifest(MODEL).revision
        over = [start_of(a), chunk_of("head.weight", 0, b"\0" * (4 * 1024 * 1024 + 16))]
        with pytest.raises(grpc.RpcError) as refused:
            next(stub.PublishTensors(iter(over), timeout=30))
        assert refused.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert "head.weight" in (refused.value.details() or "")
        bad = chunk_of("head.weight", 0, b"\1" * 64)
        bad.chunks[0].crc32c ^= 1
        with pytest.raises(grpc.RpcError) as corrupt:
            next(stub.PublishTensors(iter([start_of(a), bad]), timeout=30))
        assert corrupt.value.code() == grpc.StatusCode.DATA_LOSS
        short = [start_of(a), chunk_of("head.weight", 0, b"\0" * 64), pb.PublishRequest(commit=True)]
        with pytest.raises(grpc.RpcError) as incomplete:
            next(stub.PublishTensors(iter(short), timeout=30))
        assert incomplete.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.manifest(MODEL).revision == current
        client.publish(MODEL, changed(a, ["head.weight"], seed=6))  # and the next publish works


def test_concurrent_publishers_one_wins_and_a_publisher_gone_midway_leaves_nothing(server: WeightStreamServer) -> None:
    a = state_of(0)
    release = threading.Event()

    def slow() -> Iterator[pb.PublishRequest]:
        yield start_of(a, revision="slow")
        yield chunk_of("head.weight", 0, b"\0" * 1024)
        release.wait(30)  # the publisher stops here, then goes away

    channel, stub = raw_stub(server)
    with channel, client_of(server) as client:
        current = client.manifest(MODEL).revision
        call = stub.PublishTensors(slow(), timeout=60)
        deadline = time.monotonic() + 10
        while server.publisher.pending_bytes() == 0 and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.02)
        with pytest.raises(AbortedError, match="'slow' is being published"):
            client.publish(MODEL, changed(a, ["head.weight"], seed=7))
        call.cancel()  # the slow publisher goes away midway
        release.set()
        deadline = time.monotonic() + 10
        while server.publisher.pending_bytes() and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.02)
        assert client.manifest(MODEL).revision == current
        with pytest.raises(FailedPreconditionError, match="changed"):  # never published: not a revision here
            client.manifest(MODEL, revision="slow")
        b = changed(a, ["head.weight"], seed=8)
        revision_b = client.publish(MODEL, b)
        module = module_of(a)
        client.load_into(module, MODEL)
        assert_holds(module, b)
        assert client.manifest(MODEL).revision == revision_b


def test_a_revision_published_in_parts_is_current_only_once_every_part_arrived(server: WeightStreamServer) -> None:
    a = state_of(0)
    b = changed(a, list(SHAPES), seed=9)
    names = list(SHAPES)
    parts = [dict((n, b[n]) for n in names[i::3]) for i in range(3)]
    results: dict[int, str] = {}
    with client_of(server) as client:
        current = client.manifest(MODEL).revision

        def publish(index: int) -> None:
            with client_of(server) as rank:
                results[index] = rank.publish(MODEL, parts[index], revision="sharded", part=index, parts=3)

        first_two = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
        for thread in first_two:
            thread.start()
        time.sleep(0.5)
        assert client.manifest(MODEL).revision == current  # two of three parts: not yet
        publish(2)
        for thread in first_two:
            thread.join(timeout=30)
        assert results == {0: "sharded", 1: "sharded", 2: "sharded"}
        module = module_of(a)
        client.load_into(module, MODEL)
    assert_holds(module, b)


def test_the_cli_publishes_a_folder_and_watches_it_arrive(
    server: WeightStreamServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from weightstream.cli import main

    target = f"127.0.0.1:{server.port}"
    b = changed(state_of(0), ["layers.1.weight"], seed=10)
    folder = tmp_path / "step-7"
    folder.mkdir()
    save_file(b, str(folder / "model.safetensors"))
    assert main(["publish", str(folder), MODEL, "--target", target, "--revision", "step-7"]) == 0
    assert "revision step-7" in capsys.readouterr().out
    assert main(["watch", MODEL, "--target", target, "--count", "1"]) == 0
    line = json.loads(capsys.readouterr().out.strip())
    assert line["revision"] == "step-7" and line["origin"] == "published"
    assert main(["publish", str(folder / "missing.safetensors"), MODEL, "--target", target]) == 1
    module = module_of(b)
    with client_of(server) as client:
        client.load_into(module, MODEL)
    assert_holds(module, b)


def test_status_and_metrics_show_revisions_publishes_and_updates(root: Path) -> None:
    from tests.support.servers import running

    a = state_of(0)
    with running(root, allow_publish=True) as r, client_of(r.server) as client:
        since = client.manifest(MODEL).revision
        b = changed(a, ["head.weight"], seed=11)
        revision = client.publish(MODEL, b, revision="step-9")
        client.update_into(module_of(a), MODEL, since=since)
        status = r.get("/status").json()["revisions"]
        assert status["models"][MODEL]["current"] == revision
        assert status["models"][MODEL]["origin"] == "published"
        assert status["models"][MODEL]["kept"] == [since, revision]
        assert status["publishes_total"] == 1 and status["changes_total"] == 1
        assert status["changed_bytes_total"] == nbytes(b, ["head.weight"])
        assert status["published_bytes_held"] >= nbytes(b, list(b))
        metrics = r.get("/metrics").text
        assert f'weightstream_model_revision{{model="{MODEL}",origin="published",revision="step-9"}} 1.0' in metrics
        assert "weightstream_publishes_total 1.0" in metrics


@pytest.mark.slow
def test_watches_opened_and_abandoned_in_a_loop_give_their_slots_back(root: Path) -> None:
    """--max-watches 4: one client (one host) may hold 2; each round opens 2, is refused a third, and
    abandons them; every round gets its 2 again, within about --watch-interval."""
    from weightstream.client import ResourceExhaustedError

    settings = loopback_settings(model_root=root, allow_publish=True, max_watches=4, watch_interval=0.1)
    with serving(settings) as s, client_of(s) as client:
        for _ in range(10):
            # Seconds, not --watch-interval: a server on a loaded 2-core host notices a cancel late.
            deadline = time.monotonic() + 15
            while True:
                try:
                    watches = [client.watch(MODEL) for _ in range(2)]
                    for watch in watches:
                        next(watch)
                    break
                except ResourceExhaustedError:
                    for watch in watches:
                        watch.close()
                    assert time.monotonic() < deadline, "abandoned watches kept their slots"
                    time.sleep(0.05)
            third = client.watch(MODEL)
            with pytest.raises(ResourceExhaustedError, match="--max-watches"):
                next(third)
            for watch in watches:
                watch.close()
        assert client.manifest(MODEL).revision  # and the server serves as before


def test_an_update_cut_midway_says_the_module_was_partly_written_and_a_retry_completes_it(
    server: WeightStreamServer,
) -> None:
    from tests.support.faults import CuttingProxy
    from weightstream.client import WeightStreamError

    a = state_of(0)
    names = ["embed.weight", "head.weight", "layers.2.weight"]
    b = changed(a, names, seed=12)
    module = module_of(a)
    with client_of(server) as client:
        since = client.load_into(module, MODEL).revision
        client.publish(MODEL, b)
    # The first connection through the proxy is reset after 6 MiB of the 9 MiB the update needs,
    # once the client has had time to read them (its first 4 MiB message lands).
    with CuttingProxy(server.port, [(6 << 20, "drain")]) as proxy:
        with (
            WeightStreamClient(proxy.target, progress=False, transport="grpc", retry=None) as cut,
            pytest.raises(WeightStreamError) as failed,
        ):
            cut.update_into(module, MODEL, since=since)
        assert proxy.cuts == 1
    assert failed.value.partially_written, failed.value
    assert "partly written" in str(failed.value)
    assert not all(torch.equal(dict(module.named_parameters())[n], b[n]) for n in names)
    with client_of(server) as client:
        report = client.update_into(module, MODEL, since=since)
    assert_holds(module, b)
    assert report.tensors == len(names)


def test_a_complete_revision_is_written_to_the_publish_dir_and_served_from_there(root: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    published = tmp_path / "published"
    b = changed(state_of(0), ["layers.4.weight"], seed=13)
    with serving(loopback_settings(model_root=root, allow_publish=True, publish_dir=published)) as s, client_of(s) as c:
        with pytest.raises(InvalidArgumentError, match="revision name"):
            c.publish(MODEL, b, revision="../escape")
        revision = c.publish(MODEL, b, revision="step-5")
        folder = published / MODEL / revision
        deadline = time.monotonic() + 30
        while not folder.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    files = sorted(folder.glob("*.safetensors"))
    assert [f.name for f in files] == ["model-00001-of-00001.safetensors"]
    assert not [p for p in (published / MODEL).iterdir() if p.name.startswith(".") and p.is_dir()], "no partial left"
    on_disk = load_file(str(files[0]))
    assert set(on_disk) == set(b) and all(torch.equal(on_disk[n], b[n]) for n in b)
    with serving(loopback_settings(model_root=published)) as s, client_of(s) as c:
        module = module_of(b)
        c.load_into(module, f"{MODEL}/{revision}")
    assert_holds(module, b)


@pytest.mark.slow
def test_a_complete_revision_is_uploaded_to_the_publish_s3_prefix_index_first_and_served_from_there(
    root: Path, s3_store: S3Process
) -> None:
    prefix = f"s3://{S3_BUCKET}/published"
    settings = loopback_settings(
        model_root=root,
        allow_publish=True,
        publish_s3_prefix=prefix,
        s3_endpoint=s3_store.endpoint,
        s3_region=REGION,
        s3_path_style=True,
    )
    b = changed(state_of(0), ["layers.6.weight"], seed=21)
    with serving(settings) as s, client_of(s) as c:
        revision = c.publish(MODEL, b, revision="step-7")
    store = s3_store.client()
    key = f"published/{MODEL}/{revision}/"
    eventually(
        lambda: len(store.list_objects_v2(Bucket=S3_BUCKET, Prefix=key).get("Contents", [])) == 2,
        "the revision's index and file were uploaded",
    )
    index = json.loads(store.get_object(Bucket=S3_BUCKET, Key=key + INDEX_FILE)["Body"].read())
    assert set(index["weight_map"]) == set(b) and set(index["weight_map"].values()) == {
        "model-00001-of-00001.safetensors"
    }
    with serving(s3_settings(s3_store)) as reader, client_of(reader) as r:
        module = module_of(b)
        r.load_into(module, f"{prefix}/{MODEL}/{revision}")
    assert_holds(module, b)


PUBLISHER_KILLED_MIDWAY = """
import sys, time
import grpc
from weightstream.protocol import wire
from weightstream.v1 import weightstream_pb2 as pb, weightstream_pb2_grpc as pb_grpc

def requests():
    start = pb.PublishStart(model=sys.argv[2], revision="doomed", new_layout=True)
    for name, rows in (("embed.weight", 1024), ("head.weight", 1024)):
        start.tensors.append(pb.PublishedTensor(name=name, dtype=pb.DATA_TYPE_FLOAT32, shape=[rows, 1024]))
    yield pb.PublishRequest(start=start)
    data = bytes(1 << 20)
    chunk = pb.TensorChunk(tensor="embed.weight", offset=0, length=len(data), crc32c=wire.crc32c(data), data=data)
    yield pb.PublishRequest(chunks=[chunk])
    print("sent", flush=True)
    time.sleep(120)

with grpc.insecure_channel(sys.argv[1]) as channel:
    next(pb_grpc.WeightStreamServiceStub(channel).PublishTensors(requests(), timeout=300))
"""


def test_a_publisher_killed_midway_leaves_the_current_revision_and_the_next_publish_works(
    server: WeightStreamServer,
) -> None:
    import signal
    import subprocess
    import sys

    assert server.publisher is not None
    with client_of(server) as client:
        current = client.manifest(MODEL).revision
        publisher = subprocess.Popen(
            [sys.executable, "-c", PUBLISHER_KILLED_MIDWAY, f"127.0.0.1:{server.port}", MODEL],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert publisher.stdout is not None and publisher.stdout.readline().strip() == "sent"
            deadline = time.monotonic() + 10
            while server.publisher.pending_bytes() == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert server.publisher.pending_bytes() > 0, "the publish is in flight"
            publisher.send_signal(signal.SIGKILL)
            publisher.wait(timeout=10)
        finally:
            publisher.kill()
        deadline = time.monotonic() + 30
        while server.publisher.pending_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.publisher.pending_bytes() == 0, "the dead publisher's revision was dropped"
        assert client.manifest(MODEL).revision == current
        b = changed(state_of(0), ["head.weight"], seed=14)
        revision = client.publish(MODEL, b)
        module = module_of(b)
        client.load_into(module, MODEL)
        assert_holds(module, b)
        assert client.manifest(MODEL).revision == revision


def test_hostile_publishes_over_budget_or_gone_silent_hold_nothing(root: Path) -> None:
    """A publish that would hold more than --publish-max-bytes is refused before any byte is taken;
    a publisher that stops sending is ended after --stall-timeout and its part is dropped."""
    from weightstream.client import ResourceExhaustedError

    a = state_of(0)
    total = nbytes(a, list(a))
    settings = loopback_settings(model_root=root, allow_publish=True, publish_max_bytes=total // 2, stall_timeout=1.0)
    with serving(settings) as s, client_of(s) as client:
        assert s.publisher is not None
        current = client.manifest(MODEL).revision
        with pytest.raises(ResourceExhaustedError, match="--publish-max-bytes"):
            client.publish(MODEL, changed(a, ["head.weight"], seed=15))
        assert s.publisher.pending_bytes() == 0
        release = threading.Event()

        def silent() -> Iterator[pb.PublishRequest]:
            start = start_of({"head.weight": a["head.weight"]}, revision="silent")
            start.start.new_layout = True
            yield start
            release.wait(30)

        channel, stub = raw_stub(s)
        with channel:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as ended:
                next(stub.PublishTensors(silent(), timeout=30))
            release.set()
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value
        assert "--stall-timeout" in (ended.value.details() or "")
        assert time.monotonic() - started < 10
        assert s.publisher.pending_bytes() == 0
        assert client.manifest(MODEL).revision == current


def test_changes_read_each_file_version_once_however_often_they_are_asked(server: WeightStreamServer) -> None:
    assert server.changes is not None
    with client_of(server) as client:
        revision = client.manifest(MODEL).revision
        for _ in range(5):
            assert client.changes(MODEL, since=revision).tensors == {}
    assert server.changes.bytes_digested == nbytes(state_of(0), list(SHAPES))
