"""Deltas against a base held only in a sidecar's disk cache: an upstream serves a model from its root,
a sidecar (--upstream, --disk-cache, no RAM cache) serves it to an engine. The upstream's file is
rewritten with a sparse step (2% of each tensor's elements); the engine's update since the old
revision comes from the sidecar as XOR deltas against the disk cache's copy of the old file.
A copy that was damaged on disk never makes a wrong result: it is found and the chunks go whole, or
(a damage the cache's check cannot see) the client's CRC32C check of each delta's result fails and
asks for those chunks again, whole. Real servers on loopback, real files, real torch modules."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import save_file

from tests.e2e.test_deltas import assert_holds, model_bytes, module_of, served, state_of, stepped
from tests.support.ports import LOOPBACK, free_ports
from tests.support.servers import eventually, loopback_settings, serving
from weightstream.client import LoadReport, WeightStreamClient
from weightstream.samples import ParameterTree
from weightstream_server import WeightStreamServer
from weightstream_server.storage import disk_cache

# An upstream and a sidecar per test, and a checkpoint rewritten under them: seconds each.
pytestmark = pytest.mark.slow

MODEL = "sparse"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root" / MODEL).mkdir(parents=True)
    save_file(state_of(0), str(tmp_path / "root" / MODEL / "model.safetensors"))
    return tmp_path / "root"


@pytest.fixture
def upstream(root: Path) -> Iterator[WeightStreamServer]:
    settings = loopback_settings(model_root=root, watch_interval=0.2, data_port=free_ports(1)[0])
    with serving(settings) as server:
        yield server


@pytest.fixture
def sidecar(upstream: WeightStreamServer, tmp_path: Path) -> Iterator[WeightStreamServer]:
    # No RAM cache: the disk cache's copy is the only place the old revision's bytes are.
    settings = loopback_settings(
        upstream=f"{LOOPBACK}:{upstream.port}",
        disk_cache=tmp_path / "cache",
        cache_bytes=0,
        watch_interval=0.2,
        data_port=free_ports(1)[0],
    )
    with serving(settings) as server:
        yield server


def rewrite_upstream(root: Path) -> None:
    """The upstream's file replaced with a sparse step of it, the way tools write a checkpoint."""
    staged = root / MODEL / "model.safetensors.incoming"
    save_file(stepped(state_of(0), 0.02, seed=1), str(staged))
    staged.replace(root / MODEL / "model.safetensors")


def cached_files(sidecar: WeightStreamServer) -> list[Path]:
    directory = sidecar.settings.disk_cache
    assert directory is not None
    return sorted(p for p in (directory / disk_cache.FILES).iterdir() if not p.name.endswith(disk_cache.RECORD_SUFFIX))


def damage(path: Path) -> None:
    """64 bytes in the middle of the file (inside a tensor) flipped, written in place."""
    with path.open("r+b") as f:
        middle = path.stat().st_size // 2
        f.seek(middle)
        flipped = bytes(byte ^ 0xFF for byte in f.read(64))
        f.seek(middle)
        f.write(flipped)


@dataclass
class Update:
    report: LoadReport
    module: ParameterTree
    # Bytes the sidecar sent its client for the update, and read from its upstream from the rewrite on.
    to_client: int
    from_upstream: int


def update_after_rewrite(
    sidecar: WeightStreamServer, root: Path, transport: str = "tcp", before_rewrite: Callable[[], None] = lambda: None
) -> Update:
    """A loaded through the sidecar (its disk cache filled), before_rewrite(), the upstream's file
    rewritten with B and the sidecar seeing it, then the update since A."""
    with WeightStreamClient(f"{LOOPBACK}:{sidecar.port}", progress=False, transport=transport) as client:
        module = module_of(state_of(0))
        since = client.load_into(module, MODEL).revision
        assert len(cached_files(sidecar)) == 1
        before_rewrite()
        above = sidecar.tiers.source_bytes_read
        rewrite_upstream(root)
        eventually(lambda: client.manifest(MODEL).revision != since, "the sidecar saw the rewritten revision")
        before = served(sidecar)
        report = client.update_into(module, MODEL, since=since)
        return Update(report, module, served(sidecar) - before, sidecar.tiers.source_bytes_read - above)


@pytest.mark.parametrize("transport", ("tcp", "grpc"))
def test_an_update_through_a_sidecar_comes_as_deltas_against_its_disk_cache_copy(
    sidecar: WeightStreamServer, root: Path, transport: str
) -> None:
    b = stepped(state_of(0), 0.02, seed=1)
    update = update_after_rewrite(sidecar, root, transport)
    assert_holds(update.module, b)
    assert update.report.delta_chunks > 0 and update.report.delta_fallbacks == 0
    assert update.to_client <= 0.05 * model_bytes(b), (update.to_client, model_bytes(b))
    # The sidecar read B's file whole from its upstream (the link between the tiers), once.
    assert model_bytes(b) <= update.from_upstream <= 1.01 * model_bytes(b), update.from_upstream
    assert sidecar.deltas is not None
    counts = sidecar.deltas.snapshot()
    assert counts.delta_chunks > 0 and counts.delta_bytes <= 0.05 * counts.covered_bytes, counts
    # A's copy is still in the disk cache next to B's (bounded by --disk-cache-bytes like any copy).
    assert len(cached_files(sidecar)) == 2


def test_a_damaged_copy_found_by_the_disk_caches_check_is_no_base_and_the_update_goes_whole(
    sidecar: WeightStreamServer, root: Path
) -> None:
    b = stepped(state_of(0), 0.02, seed=1)
    update = update_after_rewrite(sidecar, root, before_rewrite=lambda: damage(cached_files(sidecar)[0]))
    assert_holds(update.module, b)
    assert update.report.delta_chunks == 0
    assert update.to_client >= model_bytes(b)
    assert sidecar.tiers.cache is not None and sidecar.tiers.cache.snapshot().dropped == 1


def test_a_damaged_copy_the_disk_caches_check_misses_costs_deltas_never_a_wrong_result(
    sidecar: WeightStreamServer, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The damage keeps the copy's recorded CRC32C (faked here: a collision cannot be made on purpose),
    so the sidecar computes deltas against wrong bytes; the client's check of each result against B's
    CRC32C fails for the chunk the damage is in, and that chunk comes again, whole."""
    b = stepped(state_of(0), 0.02, seed=1)
    crc_of = disk_cache._crc_of

    def damage_unseen() -> None:
        (copy,) = cached_files(sidecar)
        recorded = json.loads(copy.with_name(copy.name + disk_cache.RECORD_SUFFIX).read_text())["crc32c"]
        monkeypatch.setattr(
            disk_cache, "_crc_of", lambda path, size: recorded if path.name == copy.name else crc_of(path, size)
        )
        damage(copy)

    update = update_after_rewrite(sidecar, root, before_rewrite=damage_unseen)
    assert_holds(update.module, b)
    assert update.report.delta_chunks > 0 and update.report.delta_fallbacks >= 1
    assert sidecar.tiers.cache is not None and sidecar.tiers.cache.snapshot().dropped == 0
