"""What publishing keeps is bounded, every publish call ends with a status that tells the truth, and a
restart keeps what --publish-dir holds.

Real servers on 127.0.0.1 in this process, real safetensors folders: the publish dir holds at most
the kept revisions and is read back after a restart (current revision included, stale partial folders
removed, no folder overwritten); a multi-part revision whose other part never comes frees the model
after --publish-assembly-timeout, and at once when a waiting part's call is cancelled; a publish
stream that ends without commit, or before its start, is INVALID_ARGUMENT.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.support.ports import LOOPBACK
from tests.support.servers import eventually, loopback_settings, serving
from weightstream.client import AbortedError, WeightStreamClient
from weightstream.protocol import dtypes, wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server import WeightStreamServer
from weightstream_server.revisions.persist import REVISIONS_FILE

pytestmark = pytest.mark.slow

MODEL = "bounded"


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(33, 7, generator=generator),
        "b.bias": torch.randn(5, generator=generator).to(torch.float16),
    }


def client_of(server: WeightStreamServer) -> WeightStreamClient:
    return WeightStreamClient(f"{LOOPBACK}:{server.port}", progress=False, transport="grpc")


def holds(client: WeightStreamClient, revision: str, expected: dict[str, torch.Tensor]) -> bool:
    into = {name: torch.empty_like(t) for name, t in expected.items()}
    client.load_into(into, MODEL, revision=revision)
    return all(torch.equal(into[n], expected[n]) for n in expected)


def revision_folders(publish_dir: Path) -> list[str]:
    return sorted(p.name for p in (publish_dir / MODEL).iterdir() if p.is_dir())


def test_the_publish_dir_holds_the_kept_revisions_and_a_restart_takes_them_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    publish_dir = tmp_path / "published"
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, publish_dir=publish_dir, keep_revisions=2)
    with serving(settings) as server, client_of(server) as client:
        for step in range(5):
            client.publish(MODEL, state(step), revision=f"step-{step}", new_layout=True)
            eventually(lambda step=step: (publish_dir / MODEL / f"step-{step}").is_dir(), f"step-{step} on disk")
        eventually(lambda: revision_folders(publish_dir) == ["step-3", "step-4"], "only the kept revisions on disk")
    listed = json.loads((publish_dir / MODEL / REVISIONS_FILE).read_text())
    assert listed == {"current": "step-4", "revisions": ["step-3", "step-4"]}

    # A crash mid-write leaves a hidden partial folder; a restart removes it (and says so).
    stale = publish_dir / MODEL / ".step-5.partial-0123456789ab"
    stale.mkdir()
    (stale / "model-00001-of-00001.safetensors").write_bytes(b"half")
    with serving(settings) as server, client_of(server) as client:
        assert not stale.exists()
        assert any("did not finish" in r.getMessage() for r in caplog.records)
        assert client.manifest(MODEL).revision == "step-4"
        assert holds(client, "step-4", state(4))
        assert holds(client, "step-3", state(3))
        # A name whose folder exists is never published (and so never overwritten) again.
        with pytest.raises(AbortedError, match="already"):
            client.publish(MODEL, state(9), revision="step-4")
        before = (publish_dir / MODEL / "step-3" / "model-00001-of-00001.safetensors").read_bytes()
        client.publish(MODEL, state(5), revision="step-5")
        eventually(lambda: revision_folders(publish_dir) == ["step-4", "step-5"], "step-3 pruned after step-5")
        assert before  # step-3 was whole until it was removed, never rewritten
    with serving(settings) as server, client_of(server) as client:
        assert client.manifest(MODEL).revision == "step-5"
        assert holds(client, "step-5", state(5))


def test_a_revision_folder_that_exists_is_not_overwritten_by_a_write(tmp_path: Path) -> None:
    publish_dir = tmp_path / "published"
    (publish_dir / MODEL / "taken").mkdir(parents=True)
    (publish_dir / MODEL / "taken" / "keep.txt").write_text("mine")
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, publish_dir=publish_dir)
    with serving(settings) as server, client_of(server) as client:
        with pytest.raises(AbortedError, match="publish dir"):
            client.publish(MODEL, state(1), revision="taken", new_layout=True)
    assert (publish_dir / MODEL / "taken" / "keep.txt").read_text() == "mine"


def start_of(tensors: dict[str, torch.Tensor], revision: str, part: int, parts: int) -> pb.PublishRequest:
    start = pb.PublishStart(model=MODEL, revision=revision, part=part, parts=parts, new_layout=True)
    for name, tensor in tensors.items():
        start.tensors.append(
            pb.PublishedTensor(name=name, dtype=dtypes.BY_TORCH[tensor.dtype].wire, shape=list(tensor.shape))
        )
    return pb.PublishRequest(start=start)


def whole(tensors: dict[str, torch.Tensor]) -> Iterator[pb.PublishRequest]:
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
        chunk = pb.TensorChunk(tensor=name, offset=0, length=len(data), data=data, crc32c=wire.crc32c(data))
        yield pb.PublishRequest(chunks=[chunk])
    yield pb.PublishRequest(commit=True)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[WeightStreamServer]:
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, publish_assembly_timeout=2.0)
    with serving(settings) as s:
        yield s


def test_a_part_whose_sibling_never_comes_frees_the_model_after_the_assembly_timeout(
    server: WeightStreamServer,
) -> None:
    part0 = {"a.weight": state(1)["a.weight"]}
    with grpc.insecure_channel(f"{LOOPBACK}:{server.port}") as channel:
        stub = pb_grpc.WeightStreamServiceStub(channel)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as failed:
            list(stub.PublishTensors(iter([start_of(part0, "halves", 0, 2), *whole(part0)]), timeout=30))
        assert failed.value.code() == grpc.StatusCode.ABORTED
        assert "did not begin to arrive within 2 s" in (failed.value.details() or "")
        assert time.monotonic() - started < 10
    with client_of(server) as client:  # the model takes publishes again
        assert client.publish(MODEL, state(2), revision="after", new_layout=True) == "after"


def test_a_waiting_part_whose_call_is_cancelled_drops_its_revision_at_once(tmp_path: Path) -> None:
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, publish_assembly_timeout=120.0)
    part0 = {"a.weight": state(1)["a.weight"]}
    with serving(settings) as server, grpc.insecure_channel(f"{LOOPBACK}:{server.port}") as channel:
        stub = pb_grpc.WeightStreamServiceStub(channel)
        call = stub.PublishTensors(iter([start_of(part0, "halves", 0, 2), *whole(part0)]))
        with client_of(server) as client:
            eventually(lambda: server.publisher is not None and server.publisher.pending_bytes() > 0, "part 0 held")
            call.cancel()
            eventually(lambda: server.publisher is not None and server.publisher.pending_bytes() == 0, "part 0 gone")
            assert client.publish(MODEL, state(2), revision="next", new_layout=True) == "next"


@pytest.mark.parametrize("sent", ["nothing", "start only", "chunks without commit"])
def test_a_publish_stream_that_ends_without_commit_is_invalid_argument_naming_what_was_dropped(
    server: WeightStreamServer, sent: str
) -> None:
    tensors = state(3)
    messages = {
        "nothing": [],
        "start only": [start_of(tensors, "", 0, 1)],
        "chunks without commit": [start_of(tensors, "", 0, 1), *list(whole(tensors))[:-1]],
    }[sent]
    with grpc.insecure_channel(f"{LOOPBACK}:{server.port}") as channel:
        stub = pb_grpc.WeightStreamServiceStub(channel)
        with pytest.raises(grpc.RpcError) as failed:
            list(stub.PublishTensors(iter(messages), timeout=30))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = failed.value.details() or ""
    assert "nothing was published" in details, details
    with client_of(server) as client:
        with pytest.raises(Exception, match="not"):
            client.manifest(MODEL)  # nothing became current
    assert threading.active_count() < 200


def test_a_model_whose_folder_would_lie_in_another_models_revision_is_not_written_and_links_are_refused(
    tmp_path: Path,
) -> None:
    publish_dir = tmp_path / "published"
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, publish_dir=publish_dir, keep_revisions=1)
    with serving(settings) as server, client_of(server) as client:
        client.publish(MODEL, state(1), revision="x", new_layout=True)
        eventually(lambda: (publish_dir / MODEL / REVISIONS_FILE).exists(), "revision x listed")
        inner = f"{MODEL}/x"
        client.publish(inner, state(2), revision="r1", new_layout=True)
        client.publish(MODEL, state(3), revision="y", new_layout=True)  # prunes x: never what lies inside it
        eventually(lambda: (publish_dir / MODEL / "y").is_dir(), "revision y on disk")
        (publish_dir / "linked").symlink_to(publish_dir / MODEL)
        client.publish("linked", state(4), revision="z", new_layout=True)
        time.sleep(0.5)
    assert not (publish_dir / MODEL / "x" / "r1").exists(), "model m/x was never written inside revision x of m"
    assert not (publish_dir / MODEL / "z").exists(), "a link in the publish dir is not followed"


class HeldOpen:
    """Request messages handed to a call one at a time, the call's request side open until close()."""

    def __init__(self) -> None:
        self._queue: queue.Queue[pb.PublishRequest | None] = queue.Queue()

    def send(self, message: pb.PublishRequest) -> None:
        self._queue.put(message)

    def close(self) -> None:
        self._queue.put(None)

    def __iter__(self) -> Iterator[pb.PublishRequest]:
        while (message := self._queue.get(timeout=30)) is not None:
            yield message


def test_a_dropped_revision_counts_its_parts_memory_until_their_calls_end(tmp_path: Path) -> None:
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, publish_max_bytes=1024 * 1024)
    big = {"big": torch.zeros(150_000, dtype=torch.float32)}  # 600 KB: two would not fit
    small = {"small": torch.ones(4)}
    with serving(settings) as server, grpc.insecure_channel(f"{LOOPBACK}:{server.port}") as channel:
        stub = pb_grpc.WeightStreamServiceStub(channel)
        part0 = HeldOpen()
        part0.send(start_of(big, "halves", 0, 2))
        call0 = stub.PublishTensors(iter(part0))
        assert server.publisher is not None
        eventually(lambda: server.publisher is not None and server.publisher.pending_bytes() >= 600_000, "part 0 held")
        bad = pb.TensorChunk(tensor="small", offset=0, length=16, data=b"\0" * 16, crc32c=1)
        with pytest.raises(grpc.RpcError) as failed:
            list(
                stub.PublishTensors(
                    iter([start_of(small, "halves", 1, 2), pb.PublishRequest(chunks=[bad])]), timeout=30
                )
            )
        assert failed.value.code() == grpc.StatusCode.DATA_LOSS
        # Part 0's call still holds its buffer: its memory still counts.
        assert server.publisher.pending_bytes() >= 600_000
        with client_of(server) as client, pytest.raises(Exception, match="publish-max-bytes"):
            client.publish("other", {"big": torch.zeros(150_000)}, new_layout=True)
        # Its next chunk is refused: the revision is gone.
        part0.send(next(whole(big)))
        with pytest.raises(grpc.RpcError) as ended:
            list(call0)
        assert ended.value.code() == grpc.StatusCode.ABORTED, ended.value.details()
        assert "dropped" in (ended.value.details() or "")
        eventually(
            lambda: server.publisher is not None and server.publisher.pending_bytes() == 0, "memory counted free"
        )
        part0.close()
        with client_of(server) as client:
            assert client.publish("other", {"big": torch.zeros(150_000)}, new_layout=True)


def test_empty_tensors_count_against_the_publish_memory(tmp_path: Path) -> None:
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, publish_max_bytes=100 * 1024)
    empties = {f"e{i}": torch.zeros(0) for i in range(1000)}
    with serving(settings) as server, client_of(server) as client:
        with pytest.raises(Exception, match="publish-max-bytes"):
            client.publish(MODEL, empties, new_layout=True)
        assert client.publish(MODEL, dict(list(empties.items())[:10]), new_layout=True)


def test_revisions_published_faster_than_the_disk_takes_them_use_one_writer(tmp_path: Path) -> None:
    publish_dir = tmp_path / "published"
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, publish_dir=publish_dir, keep_revisions=2)
    with serving(settings) as server, client_of(server) as client:
        for step in range(20):
            client.publish(MODEL, state(step), revision=f"s{step}", new_layout=True)
            writers = [t for t in threading.enumerate() if t.name == "weightstream-persist"]
            assert len(writers) <= 1
        eventually(lambda: (publish_dir / MODEL / "s19").is_dir(), "the newest revision on disk")
        eventually(lambda: len(revision_folders(publish_dir)) <= 2, "at most the kept revisions on disk")


def test_a_revision_that_cannot_be_read_back_is_skipped_and_the_server_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    publish_dir = tmp_path / "published"
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, publish_dir=publish_dir, keep_revisions=2)
    with serving(settings) as server, client_of(server) as client:
        for step in range(2):
            client.publish(MODEL, state(step), revision=f"step-{step}", new_layout=True)
        listed = publish_dir / MODEL / REVISIONS_FILE
        eventually(lambda: listed.exists() and json.loads(listed.read_text())["current"] == "step-1", "step-1 listed")
    (publish_dir / MODEL / "step-1" / "model-00001-of-00001.safetensors").write_bytes(b"\xff" * 64)  # garbage
    with serving(settings) as server, client_of(server) as client:
        assert any("step-1" in r.getMessage() and "current" in r.getMessage() for r in caplog.records)
        assert client.manifest(MODEL).revision == "step-0"  # the older one, said loudly
        assert holds(client, "step-0", state(0))
        assert client.publish(MODEL, state(5), revision="step-5")  # the model is not locked
