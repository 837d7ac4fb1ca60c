"""Sparse updates against a real server: changed chunks sent as XOR deltas against the revision the
client holds, over each transport, checked by CRC32C on the result; a module that did not hold the base,
damaged deltas, a base the server does not hold, and the server's delta cache (computed once, bounded)."""

from __future__ import annotations

import functools
import logging
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.support.faults import CuttingProxy
from tests.support.ports import LOOPBACK, free_ports
from tests.support.proxies import TamperingProxy
from tests.support.servers import loopback_settings, serving
from weightstream.client import (
    AbortedError,
    IntegrityError,
    NotFoundError,
    RetryPolicy,
    WeightStreamClient,
    WeightStreamError,
)
from weightstream.client.engine_updates import HostCopy
from weightstream.protocol import deltas as delta_forms
from weightstream.protocol import wire
from weightstream.samples import ParameterTree
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server import WeightStreamServer
from weightstream_server.serving import deltas as server_deltas
from weightstream_server.serving.chunks import ServedChunk
from weightstream_server.serving.deltas import Deltas
from weightstream_server.storage.reads import ChunkPlace

MODEL = "sparse"
# 12 bfloat16 tensors of 1 MiB and one of 4 MiB.
SHAPES = {f"layers.{i}.weight": (512, 1024) for i in range(12)} | {"embed.weight": (2048, 1024)}
TRANSPORTS = ("grpc", "tcp", "shm")


def state_of(seed: int) -> dict[str, torch.Tensor]:
    """The revision of seed: a dict of its own, holding tensors made once per run and shared (tests clone
    a tensor before changing it)."""
    return dict(_made_state(seed))


@functools.cache
def _made_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in SHAPES.items()}


def stepped(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """state with fraction of the elements of every tensor changed at random places (an optimizer step)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in state.items():
        flat = tensor.clone().view(-1)
        count = max(1, int(fraction * flat.numel()))
        # Drawn with repeats (randperm of every element cost most of a test's time); a few places
        # drawn twice leave the fraction about the same.
        places = torch.randint(flat.numel(), (count,), generator=generator)
        flat[places] = (flat[places].float() * 1.01 + 0.01).to(torch.bfloat16)
        out[name] = flat.view(tensor.shape)
    return out


def module_of(state: dict[str, torch.Tensor]) -> ParameterTree:
    return ParameterTree({name: (tuple(t.shape), t.dtype) for name, t in state.items()})


def assert_holds(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    got = dict(module.named_parameters())
    for name, tensor in state.items():
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name


def model_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="weightstream-test-deltas-", dir="/dev/shm") as name:
        yield Path(name)


@pytest.fixture
def server(tmp_path: Path, shm_dir: Path) -> Iterator[WeightStreamServer]:
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, shm_dir=shm_dir, data_port=free_ports(1)[0])
    with serving(settings) as s:
        yield s


def client_of(server: WeightStreamServer, transport: str = "grpc", **more: object) -> WeightStreamClient:
    options: dict[str, object] = {"progress": False, "transport": transport, **more}
    if transport == "shm":
        options["shm_dir"] = server.settings.shm_dir
    return WeightStreamClient(f"127.0.0.1:{server.port}", **options)  # type: ignore[arg-type]


def holding_a_then_b(
    client: WeightStreamClient, modules: list[torch.nn.Module], a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]
) -> str:
    """Publish a, load it into modules, publish b; a's revision (what the modules hold)."""
    revision_a = client.publish(MODEL, a)
    for module in modules:
        client.load_into(module, MODEL)
    client.publish(MODEL, b)
    return revision_a


def served(server: WeightStreamServer) -> int:
    return server.stats.snapshot().bytes_served_total


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_sparse_step_travels_as_deltas_and_lands_bit_exact(server: WeightStreamServer, transport: str) -> None:
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    module = module_of(a)
    with client_of(server, transport) as client:
        revision_a = client.publish(MODEL, a)
        client.load_into(module, MODEL)
        assert_holds(module, a)
        client.publish(MODEL, b)
        before = served(server)
        report = client.update_into(module, MODEL, since=revision_a)
        sent = served(server) - before
    assert_holds(module, b)
    assert report.transport == transport
    assert report.delta_chunks > 0 and report.delta_fallbacks == 0
    # Every 1 MiB block changed, so without deltas the whole model would travel.
    assert report.bytes == model_bytes(b)
    assert sent == report.delta_bytes + (report.bytes - _covered(server))
    assert sent <= 0.15 * model_bytes(b), sent


def _covered(server: WeightStreamServer) -> int:
    assert server.deltas is not None
    return server.deltas.stats.covered_bytes


@pytest.mark.slow
def test_a_stream_cut_while_deltas_are_being_applied_resumes_without_falling_back(tmp_path: Path) -> None:
    """The client applies host deltas on threads of its own while it receives the next: a data connection
    cut mid-update must wait for those, count what they landed, and resume with only the rest (a delta
    applied twice would undo itself and fail its check)."""
    a = state_of(0)
    b = stepped(a, 0.05, seed=5)
    module, probe = module_of(a), module_of(a)
    data_port = free_ports(1)[0]
    policy = RetryPolicy(attempts=20, initial_backoff=0.05, max_backoff=0.5, total_deadline=60.0, idle_timeout=30.0)
    with CuttingProxy(data_port, [(450 << 10, "drain")]) as proxy:
        settings = loopback_settings(
            model_root=tmp_path, allow_publish=True, data_port=data_port, data_advertise=f"{LOOPBACK}:{proxy.port}"
        )
        with serving(settings) as server:
            with client_of(server) as direct:  # gRPC: no data connection
                revision_a = holding_a_then_b(direct, [module, probe], a, b)
                whole_stream = direct.update_into(probe, MODEL, since=revision_a)
            assert whole_stream.delta_fallbacks == 0 and whole_stream.delta_bytes > 600 << 10
            with client_of(server, "tcp", retry=policy) as client:
                report = client.update_into(module, MODEL, since=revision_a)
        assert proxy.cuts == 1
    assert_holds(module, b)
    assert report.transport == "tcp"
    assert report.retries == 1
    assert report.delta_fallbacks == 0
    assert report.delta_chunks == whole_stream.delta_chunks


def test_deltas_off_on_the_client_send_the_changed_chunks_whole(server: WeightStreamServer) -> None:
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    module = module_of(a)
    with client_of(server) as client:
        revision_a = holding_a_then_b(client, [module], a, b)
        before = served(server)
        report = client.update_into(module, MODEL, since=revision_a, deltas=False)
        sent = served(server) - before
    assert_holds(module, b)
    assert report.delta_chunks == 0
    assert sent == model_bytes(b)


@pytest.mark.parametrize("transport", ("grpc", "tcp"))
def test_a_module_that_does_not_hold_the_base_ends_at_the_new_revision_through_whole_chunks(
    server: WeightStreamServer, transport: str
) -> None:
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    module = module_of(a)
    # 1 MiB chunks: embed.weight's 4 MiB come in four, each as a delta the module cannot take.
    with client_of(server, transport, chunk_bytes=1024 * 1024) as client:
        revision_a = client.publish(MODEL, a)
        client.load_into(module, MODEL)
        with torch.no_grad():  # somebody wrote into two parameters since
            module.get_parameter("layers.4.weight").view(-1)[1000:1010] += 1
            module.get_parameter("embed.weight").fill_(0.5)
        client.publish(MODEL, b)
        report = client.update_into(module, MODEL, since=revision_a)
    assert_holds(module, b)
    # layers.4: its first chunk; embed: every chunk it got as a delta before the first failed check.
    assert report.delta_fallbacks >= 2
    assert report.delta_chunks > 0


def test_damaged_deltas_are_caught_and_the_chunks_come_whole(
    server: WeightStreamServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The damage is made on the server, in the payloads it computes (a loopback connection does not
    corrupt bytes by itself): one byte flipped inside every third frame's compressed data, and
    every fifth frame cut short."""
    deltas = server.deltas
    assert deltas is not None
    compute = deltas._compute
    made = {"count": 0}

    def damaged(base: object, slice_: object, chunk: ServedChunk, work: object) -> tuple[int, bytes] | None:
        delta = compute(base, slice_, chunk, work)  # type: ignore[arg-type]
        if delta is None:
            return None
        encoding, payload = delta
        made["count"] += 1
        if made["count"] % 5 == 0:
            return encoding, payload[: len(payload) // 2]
        if made["count"] % 3 == 0:
            spoiled = bytearray(payload)
            spoiled[len(spoiled) // 2] ^= 0x40
            return encoding, bytes(spoiled)
        return delta

    monkeypatch.setattr(deltas, "_compute", damaged)
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    module = module_of(a)
    with client_of(server, "tcp") as client:
        revision_a = holding_a_then_b(client, [module], a, b)
        report = client.update_into(module, MODEL, since=revision_a)
    assert_holds(module, b)
    assert made["count"] >= 5
    assert report.delta_fallbacks >= 2
    assert report.revision == client_revision(server)


def client_revision(server: WeightStreamServer) -> str:
    with client_of(server) as client:
        return client.manifest(MODEL).revision


def test_a_base_the_server_does_not_hold_in_memory_gets_whole_chunks_and_no_error(
    tmp_path: Path, server: WeightStreamServer
) -> None:
    """A is a storage revision (a file under the root): the server knows what changed (block CRC32Cs)
    but does not hold A's bytes in memory, so the changed chunks go whole."""
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    (tmp_path / MODEL).mkdir()
    save_file(a, str(tmp_path / MODEL / "model.safetensors"))
    module = module_of(a)
    with client_of(server, "tcp") as client:
        revision_a = client.load_into(module, MODEL).revision
        client.publish(MODEL, b)
        before = served(server)
        report = client.update_into(module, MODEL, since=revision_a)
        sent = served(server) - before
    assert_holds(module, b)
    assert report.delta_chunks == 0 and report.delta_fallbacks == 0
    assert sent == report.bytes == model_bytes(b)


def test_four_engines_updating_at_once_cost_one_computation_per_chunk(server: WeightStreamServer) -> None:
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    modules = [module_of(a) for _ in range(4)]
    with client_of(server, "tcp") as client:
        revision_a = holding_a_then_b(client, modules, a, b)
        reports: list[object] = [None] * 4
        errors: list[BaseException] = []

        def update(index: int) -> None:
            try:
                with client_of(server, "tcp") as own:
                    reports[index] = own.update_into(modules[index], MODEL, since=revision_a)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=update, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not errors, errors
    for module in modules:
        assert_holds(module, b)
    assert server.deltas is not None
    stats = server.deltas.stats
    chunks = stats.delta_chunks + stats.raw_chunks
    assert chunks % 4 == 0 and chunks > 0
    assert stats.computed == chunks // 4, (stats.computed, chunks)
    assert stats.reused == chunks - chunks // 4


def test_the_delta_cache_stays_within_its_budget() -> None:
    """Many (A, B) pairs asked for at once, from 8 threads: what is kept never exceeds the budget, and
    each key is computed once while it is kept."""
    budget = 256 * 1024
    deltas = Deltas(budget)
    computed: dict[tuple[object, ...], int] = {}
    lock = threading.Lock()

    def compute_for(key: tuple[object, ...]) -> tuple[int, bytes]:
        with lock:
            computed[key] = computed.get(key, 0) + 1
        return delta_forms.XOR_ZSTD, bytes(16 * 1024)

    def ask(worker: int) -> None:
        for pair in range(64):
            key = ("m", f"a{pair}", f"b{pair}", "t", None, 0, 16 * 1024)
            deltas._delta(key, lambda k=key: compute_for(k))  # type: ignore[misc]
            assert deltas.kept_bytes <= budget

    threads = [threading.Thread(target=ask, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert deltas.kept_bytes <= budget
    assert len(computed) == 64
    assert deltas.stats.computed + deltas.stats.reused == 8 * 64


def test_dense_chunks_are_given_up_at_the_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk whose every byte changed is sent whole after a few sampled XORs, not compressed. The
    base's bytes come from an array here (what _xor_base would read from a held revision)."""
    old = np.random.default_rng(0).integers(0, 255, 4 * 1024 * 1024, dtype=np.uint8)
    new = np.random.default_rng(1).integers(0, 255, old.size, dtype=np.uint8)
    sampled: list[int] = []

    def xor_base(
        base: object, tensor: str, slice_: object, offset: int, chunk: np.ndarray, out: np.ndarray, work: object
    ) -> None:
        sampled.append(chunk.size)
        np.bitwise_xor(chunk, old[offset : offset + chunk.size], out=out[: chunk.size])

    monkeypatch.setattr(server_deltas, "_xor_base", xor_base)
    chunk = ServedChunk(ChunkPlace("t", 0, new.size), 0, new)
    assert Deltas()._compute(None, None, chunk, server_deltas._Work()) is None  # type: ignore[arg-type]
    assert sum(sampled) <= delta_forms.SAMPLES * delta_forms.SAMPLE_BYTES
    # A sparse one is not given up: 1% of its bytes changed.
    sparse = old.copy()
    sparse[::100] ^= 1
    chunk = ServedChunk(ChunkPlace("t", 0, sparse.size), 0, sparse)
    delta = Deltas()._compute(None, None, chunk, server_deltas._Work())  # type: ignore[arg-type]
    assert delta is not None and delta[0] == delta_forms.SPARSE_XOR_ZSTD and len(delta[1]) < 0.1 * sparse.size
    # Changes close together (a tenth of the chunk, all of it changed) go in the dense form.
    clustered = old.copy()
    clustered[: old.size // 10] ^= 0x55
    chunk = ServedChunk(ChunkPlace("t", 0, clustered.size), 0, clustered)
    delta = Deltas()._compute(None, None, chunk, server_deltas._Work())  # type: ignore[arg-type]
    assert delta is not None and delta[0] == delta_forms.XOR_ZSTD and len(delta[1]) < 0.05 * clustered.size


def test_status_and_metrics_count_deltas_by_form(tmp_path: Path) -> None:
    from tests.support.servers import running

    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    with running(tmp_path, allow_publish=True) as r, client_of(r.server) as client:
        module = module_of(a)
        revision_a = holding_a_then_b(client, [module], a, b)
        report = client.update_into(module, MODEL, since=revision_a)
        deltas = r.get("/status").json()["revisions"]["deltas"]
        metrics = r.get("/metrics").text
    assert deltas["delta_chunks_total"] == report.delta_chunks > 0
    assert deltas["delta_bytes_total"] == report.delta_bytes
    assert deltas["covered_bytes_total"] == model_bytes(b)
    assert deltas["computed_total"] == report.delta_chunks and deltas["reused_total"] == 0
    assert 0 < deltas["kept_bytes"] <= report.delta_bytes
    assert f'weightstream_delta_chunks_total{{form="delta"}} {float(report.delta_chunks)}' in metrics
    assert f"weightstream_delta_bytes_total {float(report.delta_bytes)}" in metrics


@pytest.mark.parametrize("transport", ("tcp", "shm"))
def test_clustered_changes_travel_in_the_dense_form_and_land_bit_exact(
    server: WeightStreamServer, transport: str
) -> None:
    """A tenth of each tensor rewritten in one run: too many words for the sparse form, few enough
    bytes for the dense one."""
    a = state_of(0)
    generator = torch.Generator().manual_seed(5)
    b = {}
    for name, tensor in a.items():
        rows = max(1, tensor.shape[0] // 10)
        b[name] = tensor.clone()
        b[name][:rows] = torch.randn((rows, tensor.shape[1]), generator=generator).to(torch.bfloat16)
    module = module_of(a)
    with client_of(server, transport) as client:
        revision_a = holding_a_then_b(client, [module], a, b)
        report = client.update_into(module, MODEL, since=revision_a)
    assert_holds(module, b)
    assert server.deltas is not None
    stats = server.deltas.snapshot()
    assert report.delta_chunks > 0 and stats.sparse_chunks == 0 and report.delta_fallbacks == 0
    assert report.delta_bytes < 0.2 * model_bytes(a)


@pytest.mark.parametrize("dim", (0, 1))
def test_a_rank_gets_deltas_of_its_own_slices(server: WeightStreamServer, dim: int) -> None:
    """A tensor-parallel rank's slices (dim 1: gathered out of whole rows on the server) come as
    deltas against the same slices of the base, and land bit-exact."""
    from weightstream.protocol.wire import TensorSlice

    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    slices = {name: TensorSlice(dim, t.shape[dim] // 4, t.shape[dim] // 2) for name, t in a.items()}

    def part(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: t.narrow(dim, slices[n].start, slices[n].stop - slices[n].start) for n, t in state.items()}

    held = {name: torch.empty_like(t.contiguous()) for name, t in part(a).items()}
    with client_of(server, "tcp") as client:
        revision_a = holding_a_then_b(client, [], a, b)
        client.load_into(held, MODEL, revision=revision_a, shard=slices)
        before = served(server)
        report = client.update_into(held, MODEL, since=revision_a, shard=slices)
        sent = served(server) - before
    for name, tensor in part(b).items():
        assert torch.equal(held[name].view(torch.int16), tensor.contiguous().view(torch.int16)), name
    assert report.delta_chunks > 0 and report.delta_fallbacks == 0
    assert sent <= 0.15 * model_bytes(b) / 4, sent


def test_a_storage_revision_in_the_ram_cache_is_a_delta_base(tmp_path: Path) -> None:
    """A is a storage revision a full load left in the RAM cache; its file is then rewritten with B
    (2% of the elements changed). The server still holds A's units in the cache, so the update comes
    as deltas (without a cache: whole chunks, the test of a base the server does not hold)."""
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    (tmp_path / MODEL).mkdir()
    path = tmp_path / MODEL / "model.safetensors"
    save_file(a, str(path))
    settings = loopback_settings(model_root=tmp_path, cache_bytes=64 * 1024 * 1024, data_port=free_ports(1)[0])
    with serving(settings) as server, client_of(server, "tcp") as client:
        module = module_of(a)
        revision_a = client.load_into(module, MODEL).revision
        client.changes(MODEL, since=revision_a, revision=revision_a)  # A's block CRC32Cs, before the rewrite
        staged = path.with_suffix(".incoming")
        save_file(b, str(staged))
        staged.replace(path)
        assert client.manifest(MODEL).revision != revision_a
        before = served(server)
        report = client.update_into(module, MODEL, since=revision_a)
        sent = served(server) - before
        assert_holds(module, b)
        assert report.delta_chunks > 0 and report.delta_fallbacks == 0
        assert sent <= 0.15 * model_bytes(b), sent


def received(server: WeightStreamServer) -> int:
    assert server.publisher is not None
    return server.publisher.received_bytes


def assert_published(client: WeightStreamClient, state: dict[str, torch.Tensor]) -> None:
    got = client.load_state_dict(MODEL)
    for name, tensor in state.items():
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name


@pytest.mark.parametrize("transport", ("tcp", "grpc"))
def test_a_publisher_sends_only_what_changed_since_its_last_publish(server: WeightStreamServer, transport: str) -> None:
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    with client_of(server, transport) as trainer:
        trainer.publish(MODEL, a, deltas=True)
        before = received(server)
        trainer.publish(MODEL, b, deltas=True)
        sent = received(server) - before
        assert_published(trainer, b)
        # The same content again: nothing changed, nothing but the announcement travels.
        before = received(server)
        trainer.publish(MODEL, b, deltas=True, revision="b-again")
        again = received(server) - before
        assert trainer.manifest(MODEL).revision == "b-again"
        assert_published(trainer, b)
    assert 0 < sent <= 0.1 * model_bytes(b), sent
    assert again == 0


@pytest.mark.parametrize("transport", ("tcp", "grpc"))
def test_the_first_engine_after_a_delta_publish_gets_the_publishers_deltas_without_a_computation(
    server: WeightStreamServer, transport: str
) -> None:
    """A 2% step published with deltas: the first engine's update is served from the kept payloads
    (the server's computation counter does not move) and is bit-exact."""
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    module = module_of(a)
    assert server.deltas is not None
    with client_of(server, transport) as trainer, client_of(server, transport) as engine:
        revision_a = trainer.publish(MODEL, a, deltas=True)
        engine.load_into(module, MODEL)
        trainer.publish(MODEL, b, deltas=True)
        before = server.deltas.snapshot()
        report = engine.update_into(module, MODEL, since=revision_a)
        after = server.deltas.snapshot()
    assert_holds(module, b)
    assert report.delta_chunks > 0 and report.delta_fallbacks == 0
    assert after.computed == before.computed, (before, after)
    assert after.published > 0
    assert after.reused - before.reused == report.delta_chunks + (after.raw_chunks - before.raw_chunks)


@pytest.mark.parametrize("transport", ("tcp", "grpc"))
def test_auto_deltas_measure_both_ways_and_engines_take_either_without_a_computation(
    server: WeightStreamServer, transport: str
) -> None:
    """deltas="auto": the first publish against a base sends the changed chunks as deltas, the next
    sends them whole, then the faster goes on (tests/client/test_send_choice.py). Each revision is
    bit-exact, and an engine updating after each gets what the publisher sent (deltas, or whole
    chunks of the tensors that changed), with no delta computed by the server."""
    a = state_of(0)
    module = module_of(a)
    assert server.deltas is not None
    ways: list[bool] = []
    sent: list[int] = []
    # Whether the trainer kept a host copy after each publish: exactly when the next one encodes.
    copies: list[bool] = []
    with client_of(server, transport) as trainer, client_of(server, transport) as engine:
        held = trainer.publish(MODEL, a, deltas="auto")
        assert trainer.last_publish is not None
        copies.append(trainer.last_publish.host_copy)
        engine.load_into(module, MODEL)
        for seed in (1, 2, 3):
            state = stepped(a, 0.02, seed=seed)
            before = received(server)
            trainer.publish(MODEL, state, deltas="auto")
            sent.append(received(server) - before)
            assert trainer.last_publish is not None
            ways.append(trainer.last_publish.encoded)
            copies.append(trainer.last_publish.host_copy)
            assert_published(trainer, state)
            computed = server.deltas.snapshot().computed
            held = engine.update_into(module, MODEL, since=held).revision
            assert_holds(module, state)
            assert server.deltas.snapshot().computed == computed
    assert ways[:2] == [True, False], ways
    assert copies[:3] == ways, (copies, ways)
    assert 0 < sent[0] <= 0.1 * model_bytes(a)
    assert sent[1] == model_bytes(a)  # every chunk holds a change: all of them, whole
    assert (sent[2] < model_bytes(a)) == ways[2], (sent, ways)


def test_a_delta_publish_whose_base_is_gone_goes_whole(server: WeightStreamServer) -> None:
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    with client_of(server, "tcp") as trainer, client_of(server, "tcp") as other:
        trainer.publish(MODEL, a, deltas=True)
        other.publish(MODEL, stepped(a, 0.02, seed=3))
        other.publish(MODEL, stepped(a, 0.02, seed=4))  # two kept: the trainer's base is gone
        before = received(server)
        trainer.publish(MODEL, b, deltas=True)
        sent = received(server) - before
        assert_published(trainer, b)
    assert sent == model_bytes(b)


def test_hostile_delta_publishes_are_refused_and_leave_the_current_revision(server: WeightStreamServer) -> None:
    """Raw PublishTensors calls, as no client of ours sends them: a base not kept, a delta of a tensor
    the base does not hold, a delta whose result fails its CRC32C, a payload that is not zstd. Each is
    refused with its code and the model keeps its revision; then a good one lands."""
    import grpc

    from weightstream.client.revisions import publish_start
    from weightstream.protocol import deltas as forms
    from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

    a = state_of(0)
    with client_of(server) as client:
        revision_a = client.publish(MODEL, a)
    name = "layers.0.weight"
    new = a[name].clone().view(-1)
    new[::97] = (new[::97].float() + 1).to(torch.bfloat16)
    xor = (new.view(torch.uint8) ^ a[name].view(-1).view(torch.uint8)).contiguous()
    delta = forms.Codec().encode(xor, 0)
    assert delta is not None
    encoding, payload = delta
    new_bytes = new.view(torch.uint8)
    good_crc = wire.crc32c_at(new_bytes.data_ptr(), new_bytes.numel())

    def publish(base: str, chunk: pb.TensorChunk, layout: dict[str, torch.Tensor] = a) -> grpc.StatusCode:
        start = publish_start(
            MODEL, list(layout.items()), revision="", part=0, parts=1, new_layout=True, delta_base=base
        )
        requests = [pb.PublishRequest(start=start), pb.PublishRequest(chunks=[chunk]), pb.PublishRequest(commit=True)]
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            try:
                next(iter(pb_grpc.WeightStreamServiceStub(channel).PublishTensors(iter(requests))))
            except grpc.RpcError as exc:
                return exc.code()  # type: ignore[attr-defined,no-any-return]
        return grpc.StatusCode.OK

    def chunk(tensor: str = name, crc: int = good_crc, data: bytes = payload) -> pb.TensorChunk:
        return pb.TensorChunk(
            tensor=tensor,
            offset=0,
            length=xor.numel(),
            crc32c=crc,
            encoding=encoding,  # type: ignore[arg-type]
            encoded_length=len(data),
            data=data,
        )

    renamed = {("extra.weight" if n == name else n): t for n, t in a.items()}
    assert publish("no-such-revision", chunk()) == grpc.StatusCode.NOT_FOUND
    assert publish(revision_a, chunk(crc=good_crc ^ 1)) == grpc.StatusCode.DATA_LOSS
    assert publish(revision_a, chunk(data=b"not zstd at all")) == grpc.StatusCode.DATA_LOSS
    assert publish(revision_a, chunk(tensor="extra.weight"), renamed) == grpc.StatusCode.INVALID_ARGUMENT
    with client_of(server) as client:
        assert client.manifest(MODEL).revision == revision_a
    assert publish(revision_a, chunk()) == grpc.StatusCode.OK
    with client_of(server) as client:
        got = client.load_state_dict(MODEL)
    assert torch.equal(got[name].view(-1).view(torch.int16), new.view(torch.int16))
    assert torch.equal(got["embed.weight"].view(torch.int16), a["embed.weight"].view(torch.int16))


def test_a_server_that_sends_deltas_unasked_is_an_integrity_error(
    server: WeightStreamServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rogue server (ours, made to encode every tensor against A whatever the request says): the
    client asked for no deltas, so an encoded chunk is refused rather than XORed into its module."""
    from weightstream_server.serving.stream_session import StreamSession

    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    module = module_of(a)
    with client_of(server, "tcp") as client:
        revision_a = holding_a_then_b(client, [module], a, b)
        assert server.revisions is not None
        base = server.revisions.find(MODEL, revision_a)
        assert base is not None

        def rogue(self: StreamSession, request: object) -> None:
            self._delta_base = base.manifest
            self._delta_tensors = {entry.name: None for entry in self.manifest.tensors}

        monkeypatch.setattr(StreamSession, "_find_delta_base", rogue)
        with pytest.raises(IntegrityError, match="no delta was asked"):
            client.update_into(module, MODEL, since=revision_a, deltas=False)


def _once(change: Callable[[pb.TensorChunk], list[pb.TensorChunk]]) -> Callable[..., list[pb.StreamTensorsResponse]]:
    """A TamperingProxy's tamper that rewrites the first delta chunk it sees (change(chunk): what to send
    in its place), in the same message, and leaves every other chunk alone."""
    done = threading.Event()

    def tamper(response: pb.StreamTensorsResponse) -> list[pb.StreamTensorsResponse]:
        out = pb.StreamTensorsResponse()
        for chunk in response.chunks:
            if chunk.encoding and not done.is_set():
                done.set()
                out.chunks.extend(change(chunk))
            else:
                out.chunks.append(chunk)
        return [out]

    return tamper


def _plain_of(state: dict[str, torch.Tensor], chunk: pb.TensorChunk) -> pb.TensorChunk:
    """chunk's range of state's tensor as plain bytes, with their right CRC32C."""
    data = state[chunk.tensor].reshape(-1).view(torch.uint8)[chunk.offset : chunk.offset + chunk.length]
    raw = data.numpy().tobytes()
    crc = wire.crc32c(raw)
    return pb.TensorChunk(tensor=chunk.tensor, offset=chunk.offset, length=chunk.length, crc32c=crc, data=raw)


@pytest.mark.parametrize("second", ("the same delta", "the bytes whole"))
def test_a_range_sent_twice_in_one_update_is_refused(server: WeightStreamServer, second: str) -> None:
    """A hostile server (a proxy in front of ours) sends one delta chunk and then, in the same message,
    the same range again: the same delta, or the new revision's bytes whole, each with the right
    CRC32C. The first is still being applied on the client's delta threads when the second comes:
    without a guard both write there and the update ends "done" holding bytes of neither revision.
    The second is refused instead, and the error says the module was partly written."""
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    module = module_of(a)

    def twice(chunk: pb.TensorChunk) -> list[pb.TensorChunk]:
        return [chunk, chunk if second == "the same delta" else _plain_of(b, chunk)]

    with client_of(server) as client:
        revision_a = holding_a_then_b(client, [module], a, b)
    with TamperingProxy(server.port, _once(twice)) as proxy:
        with WeightStreamClient(proxy.target, progress=False, transport="grpc") as client:
            with pytest.raises(IntegrityError, match="refused") as caught:
                client.update_into(module, MODEL, since=revision_a)
        assert proxy.tampered == 1
    assert caught.value.partially_written is True


def partly_stepped(state: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    """state with 2% of the elements of names' tensors changed; the others unchanged."""
    step = stepped({n: state[n] for n in names}, 0.02, seed=seed)
    return {name: step.get(name, tensor) for name, tensor in state.items()}


def test_a_zeroed_module_updated_since_a_revision_it_never_held_ends_at_the_new_one(server: WeightStreamServer) -> None:
    """update_into(since=r1) on a module of zeros: the changed tensors' deltas fail their checks and come
    whole, and the unchanged tensors, which GetChanges tells the client to keep, are checked against
    r2's block CRC32Cs and fetched, so the module holds r2 when the report says r2."""
    a = state_of(0)
    b = partly_stepped(a, ["layers.0.weight", "layers.1.weight"], seed=1)
    module = module_of(a)  # zeros
    with client_of(server, "tcp") as client:
        revision_a = client.publish(MODEL, a)
        revision_b = client.publish(MODEL, b)
        report = client.update_into(module, MODEL, since=revision_a)
    assert report.revision == revision_b
    assert_holds(module, b)
    assert report.delta_fallbacks > 0
    unchanged = model_bytes(b) - 2 * (1 << 20)
    assert report.stale_bytes == unchanged and report.bytes == model_bytes(b)


@pytest.mark.parametrize("verify", (None, False))
def test_a_module_holding_a_later_revision_updated_since_an_earlier_one_ends_at_the_one_reported(
    tmp_path: Path, verify: bool | None
) -> None:
    """The module holds q3; update_into(since=q1, revision=q2) is told that only what changed from q1 to
    q2 needs fetching, but the module holds q3's bytes where q3 changed after q2: those blocks fail
    their check against q2's CRC32Cs and are fetched, so it ends holding q2. With
    verify_unchanged=False the client trusts since, and the module keeps q3's bytes there."""
    q1 = state_of(0)
    q2 = partly_stepped(q1, ["layers.0.weight"], seed=2)
    q3 = partly_stepped(q2, ["layers.5.weight", "embed.weight"], seed=3)
    module = module_of(q1)
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, keep_revisions=3)
    with serving(settings) as server, client_of(server) as client:
        revision_q1 = client.publish(MODEL, q1)
        revision_q2 = client.publish(MODEL, q2)
        client.publish(MODEL, q3)
        client.load_into(module, MODEL)
        assert_holds(module, q3)
        report = client.update_into(module, MODEL, since=revision_q1, revision=revision_q2, verify_unchanged=verify)
    assert report.revision == revision_q2
    if verify is None:
        assert_holds(module, q2)
        assert report.stale_bytes == 5 * (1 << 20)  # layers.5 and embed, whole: 2% of their elements changed
    else:
        assert report.stale_bytes == 0
        got = dict(module.named_parameters())
        assert torch.equal(got["embed.weight"].view(torch.int16), q3["embed.weight"].view(torch.int16))


def test_an_engine_host_copy_whose_revision_the_server_dropped_is_pulled_whole(server: WeightStreamServer) -> None:
    """An engine's host copy (engine_updates.HostCopy, what vLLM and SGLang engines with deltas keep) holds
    a revision the server no longer keeps (it keeps two): the next pull cannot ask for deltas since it,
    so it takes the new revision whole, and the copy holds it."""
    a = state_of(0)
    b, c = stepped(a, 0.02, seed=1), stepped(a, 0.02, seed=2)
    with client_of(server, "tcp") as trainer, client_of(server, "tcp") as engine:
        revision_a = trainer.publish(MODEL, a)
        copy = HostCopy(engine, MODEL, {})
        copy.pull(revision_a, logger=logging.getLogger("test"))
        trainer.publish(MODEL, b)
        revision_c = trainer.publish(MODEL, c)
        with pytest.raises(NotFoundError):
            engine.manifest(MODEL, revision=revision_a)  # two kept: b and c
        report = copy.pull(revision_c, logger=logging.getLogger("test"))
        assert report is not None and report.delta_chunks == 0 and report.bytes == model_bytes(c)
        assert copy.revision == revision_c
        held = dict(copy.tensors(list(c), torch.device("cpu")))
    for name, tensor in c.items():
        assert torch.equal(held[name].view(torch.int16), tensor.view(torch.int16)), name


@pytest.mark.parametrize("transport", ("tcp", "grpc"))
def test_after_a_delta_publish_that_failed_the_next_goes_whole_and_bit_exact(
    server: WeightStreamServer, transport: str
) -> None:
    """A delta publish brings the trainer's host copy up to date as its chunks go: one refused midway
    (here: a revision name taken, found once its chunks were on their way) leaves that copy holding
    some of each revision, so the next publish goes whole, and the server ends holding exactly it."""
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    c = stepped(b, 0.02, seed=2)
    with client_of(server, transport) as trainer:
        trainer.publish(MODEL, a, revision="r-a", deltas=True)
        trainer.publish(MODEL, b, revision="r-b", deltas=True)
        assert trainer.last_publish is not None and trainer.last_publish.sent_bytes < 0.1 * model_bytes(b)
        with pytest.raises(WeightStreamError):
            trainer.publish(MODEL, c, revision="r-a", deltas=True)  # a name the server has already
        trainer.publish(MODEL, c, revision="r-c", deltas=True)
        assert trainer.last_publish.delta_base == "" and trainer.last_publish.sent_bytes == model_bytes(c)
        assert_published(trainer, c)
        d = stepped(c, 0.02, seed=3)
        trainer.publish(MODEL, d, revision="r-d", deltas=True)
        assert trainer.last_publish.delta_base == "r-c" and trainer.last_publish.sent_bytes < 0.1 * model_bytes(d)
        assert_published(trainer, d)


def test_a_revision_name_no_longer_kept_is_not_published_again_and_its_deltas_are_dropped(tmp_path: Path) -> None:
    """Deltas are kept by revision name: an evicted revision's are dropped with it, and its name is
    refused to a later publish, so an engine holding it can never be handed the deltas of other bytes
    under the same name."""
    a = state_of(0)
    b = stepped(a, 0.02, seed=1)
    with serving(loopback_settings(model_root=tmp_path, allow_publish=True, keep_revisions=2)) as server:
        assert server.deltas is not None
        with client_of(server) as trainer:
            trainer.publish(MODEL, a, revision="B", deltas=True)
            trainer.publish(MODEL, b, revision="x", deltas=True)
            assert server.deltas.kept_bytes > 0  # the publisher's B -> x deltas
            trainer.publish(MODEL, stepped(a, 0.02, seed=7), revision="y")
            trainer.publish(MODEL, stepped(a, 0.02, seed=8), revision="z")  # B and x are no longer kept
            assert server.deltas.kept_bytes == 0
            for name in ("B", "x"):
                with pytest.raises(AbortedError, match="no longer kept; a name is not used again"):
                    trainer.publish(MODEL, a, revision=name)
            assert trainer.manifest(MODEL).revision == "z"
