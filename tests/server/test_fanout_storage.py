"""Fan-out of storage revisions: a revision's files spread through peers into sidecars' disk caches.

Real servers on 127.0.0.1 in this process: an upstream with --fanout reading a model root, and a
sidecar (--upstream, --peers, --disk-cache) that follows the model. The upstream never plans a
loopback peer, so the sidecar takes each storage revision's blocks from the upstream itself; a second
node's pull (revisions.storage_pull.StoragePull, into a disk cache of its own) is then run directly
with the sidecar, or a hostile peer in this process, as its parent (the hostile one named by an
address the upstream could plan, and dialled on loopback). The lying upstream is a client
whose block hashes are altered: an upstream that lies cannot be run here otherwise.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.hostile_peer import flipping, serve_blocks
from tests.support.ports import LOOPBACK
from tests.support.servers import eventually, loopback_settings, serving
from weightstream.client import InvalidArgumentError, NotFoundError, WeightStreamClient
from weightstream_server import WeightStreamServer
from weightstream_server.errors import StorageUnavailable
from weightstream_server.revisions.peer_blocks import Holdings
from weightstream_server.revisions.storage_pull import StoragePull
from weightstream_server.revisions.store import RevisionStore
from weightstream_server.revisions.stored_blocks import StoredBlocks
from weightstream_server.storage.disk_cache import DiskCache, cache_key
from weightstream_server.storage.sources import SourceFile
from weightstream_server.storage.tiers import TieredSource
from weightstream_server.storage.upstream import UpstreamSource

MODEL = "storage-fanout"
FILE = "model.safetensors"
# The servers' stall time: how long a request for blocks not there waits before NOT_FOUND.
STALL_S = 0.25
# A node's pull leaves a peer only after this long without a block: a busy machine does not make it fall back.
PULL_STALL_S = 5.0
MIB = 1024 * 1024
# The hostile peer's address as its puller names it (198.18.0.0/15: benchmarking, never routed here).
HOSTILE = "198.18.0.7:50051"


def _write(root: Path, seed: int) -> dict[str, torch.Tensor]:
    """The model's one file, replaced whole (a new storage revision): 3 MiB and a bit, a small tensor, an empty one."""
    generator = torch.Generator().manual_seed(seed)
    state = {
        "w": torch.randn(3 * MIB // 4 + 5, generator=generator),
        "b": torch.randn(10, generator=generator),
        "empty": torch.empty(0, 4),
    }
    (root / MODEL).mkdir(parents=True, exist_ok=True)
    staged = root / MODEL / f"{FILE}.tmp"
    save_file(state, str(staged))
    staged.replace(root / MODEL / FILE)
    return state


def _tensor_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass
class Fleet:
    root: Path
    upstream: WeightStreamServer
    sidecar: WeightStreamServer
    tmp: Path

    @property
    def upstream_target(self) -> str:
        return f"{LOOPBACK}:{self.upstream.port}"

    @property
    def sidecar_target(self) -> str:
        return f"{LOOPBACK}:{self.sidecar.port}"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    root = tmp_path / "root"
    _write(root, 0)
    up = loopback_settings(model_root=root, fanout=True, watch_interval=0.2, peer_stall_seconds=STALL_S)
    with serving(up) as upstream:
        side = loopback_settings(
            upstream=f"{LOOPBACK}:{upstream.port}",
            peers=True,
            disk_cache=tmp_path / "sidecar-cache",
            watch_interval=0.2,
            peer_stall_seconds=STALL_S,
        )
        with serving(side) as sidecar:
            yield Fleet(root, upstream, sidecar, tmp_path)


def _new_revision(fleet: Fleet, seed: int) -> tuple[str, dict[str, torch.Tensor]]:
    """Rewrite the model's file upstream; its new revision once the sidecar holds it."""
    state = _write(fleet.root, seed)
    with WeightStreamClient(fleet.upstream_target, progress=False) as client:
        revision = client.manifest(MODEL).revision
    store = fleet.sidecar.revisions
    assert store is not None

    def held() -> bool:
        current = store.current(MODEL)
        return current is not None and current.id == revision

    eventually(held, "the sidecar holding the new storage revision", timeout=20.0)
    return revision, state


@dataclass
class Node:
    """A second sidecar's disk cache and its pull of a storage revision, run in this process."""

    tier: TieredSource
    holdings: Holdings

    @property
    def cache(self) -> DiskCache:
        assert self.tier.cache is not None
        return self.tier.cache


def _node(fleet: Fleet, name: str) -> Node:
    settings = loopback_settings(upstream=fleet.upstream_target, peers=True, disk_cache=fleet.tmp / name)
    cache = DiskCache(fleet.tmp / name, 1 << 30)
    return Node(TieredSource(UpstreamSource(settings), cache), Holdings(RevisionStore()))


def _pull(
    node: Node, upstream: WeightStreamClient, revision: str, parent: str, dial: dict[str, str] | None = None
) -> StoragePull:
    def connect(target: str) -> WeightStreamClient:
        return WeightStreamClient((dial or {}).get(target, target), progress=False, retry=None)

    pull = StoragePull(node.tier, node.holdings, upstream, connect, MODEL, revision, parent, PULL_STALL_S)
    try:
        pull.run()
    finally:
        pull.close()
    return pull


def _cached_bytes(node: Node) -> bytes:
    (file,) = node.tier.inner.resolve(MODEL).files
    copy = node.cache.lookup(file)
    assert copy is not None, "the file is not in the disk cache"
    return Path(copy.path).read_bytes()


def test_a_storage_revision_reaches_a_node_through_a_peer_bit_exact_with_about_one_copy_from_the_upstream(
    fleet: Fleet,
) -> None:
    assert fleet.upstream.holdings is not None and fleet.sidecar.holdings is not None
    with WeightStreamClient(fleet.sidecar_target, progress=False) as near:
        near.manifest(MODEL)  # the sidecar follows the model from now on
        served_before = fleet.upstream.holdings.counts.served_bytes
        revision, state = _new_revision(fleet, 1)
        # The sidecar took the revision's blocks from the upstream (it is a root: no loopback peer is
        # planned) into its disk cache: one copy of the tensors.
        assert fleet.upstream.holdings.counts.served_bytes - served_before == _tensor_bytes(state)
        node = _node(fleet, "node-cache")
        read_before = node.tier.source_bytes_read
        with WeightStreamClient(fleet.upstream_target, progress=False) as upstream:
            served_mid = fleet.upstream.holdings.counts.served_bytes
            pull = _pull(node, upstream, revision, fleet.sidecar_target)
        report = pull.report
        assert report is not None
        # Every tensor byte from the peer; from the upstream only the header and the CRC's last byte.
        assert report.peer_bytes == _tensor_bytes(state) and report.upstream_bytes == 0, report
        assert fleet.upstream.holdings.counts.served_bytes == served_mid
        assert node.tier.source_bytes_read - read_before < 4096
        assert pull.files == 1
        assert _cached_bytes(node) == (fleet.root / MODEL / FILE).read_bytes()
        # The sidecar serves the revision from its disk cache: loading it reads nothing from the upstream.
        tiers_read = fleet.sidecar.tiers.source_bytes_read
        loaded = near.load_state_dict(MODEL)
        assert fleet.sidecar.tiers.source_bytes_read == tiers_read
    assert all(torch.equal(loaded[name], state[name]) for name in state)


def test_a_file_unchanged_since_is_not_pulled_again(fleet: Fleet) -> None:
    with WeightStreamClient(fleet.sidecar_target, progress=False) as near:
        near.manifest(MODEL)
        revision, _ = _new_revision(fleet, 2)
    node = _node(fleet, "node-cache")
    with WeightStreamClient(fleet.upstream_target, progress=False) as upstream:
        first = _pull(node, upstream, revision, fleet.sidecar_target)
        again = _pull(node, upstream, revision, fleet.sidecar_target)
    assert first.files == 1 and again.files == 0 and again.report is None


def test_a_peer_sending_wrong_bytes_is_refused_and_the_file_ends_bit_exact_from_the_upstream(fleet: Fleet) -> None:
    with WeightStreamClient(fleet.sidecar_target, progress=False) as near:
        near.manifest(MODEL)
        revision, state = _new_revision(fleet, 3)
    hostile, port = serve_blocks(flipping(fleet.upstream_target))
    node = _node(fleet, "node-cache")
    try:
        with WeightStreamClient(fleet.upstream_target, progress=False) as upstream:
            # Named by an address an upstream could plan (a refused loopback peer is no report it takes),
            # dialled on loopback.
            pull = _pull(node, upstream, revision, HOSTILE, {HOSTILE: f"{LOOPBACK}:{port}"})
    finally:
        hostile.stop(grace=None)
    report = pull.report
    assert report is not None
    assert report.refused == HOSTILE and node.holdings.counts.refused_blocks == 1, report
    assert report.peer_bytes == 0 and report.upstream_bytes == _tensor_bytes(state), report
    assert _cached_bytes(node) == (fleet.root / MODEL / FILE).read_bytes()


class _LyingUpstream(WeightStreamClient):
    """The upstream's client with one block hash altered: as an upstream whose hashes do not give its digest."""

    def block_hashes(self, model: str, revision: str) -> dict[str, tuple[bytes, ...]]:
        hashes = super().block_hashes(model, revision)
        first = hashes["w"]
        hashes["w"] = (bytes(32), *first[1:])
        return hashes


def test_a_failed_pull_leaves_no_file_half_written_in_the_disk_cache(fleet: Fleet) -> None:
    with WeightStreamClient(fleet.sidecar_target, progress=False) as near:
        near.manifest(MODEL)
        revision, _ = _new_revision(fleet, 4)
    node = _node(fleet, "node-cache")
    with _LyingUpstream(fleet.upstream_target, progress=False) as upstream, pytest.raises(Exception, match="digest"):
        _pull(node, upstream, revision, fleet.sidecar_target)
    assert os.listdir(fleet.tmp / "node-cache" / "files") == []
    assert os.listdir(fleet.tmp / "node-cache" / "partial") == []
    (file,) = node.tier.inner.resolve(MODEL).files
    assert node.cache.lookup(file) is None and node.cache.snapshot().filling == 0
    assert not (fleet.tmp / "node-cache" / "files" / cache_key(file)).exists()


def test_the_upstream_serves_a_storage_revisions_blocks_of_its_tensors_only(fleet: Fleet) -> None:
    with WeightStreamClient(fleet.upstream_target, progress=False) as upstream:
        old = upstream.manifest(MODEL).revision
        state = _write(fleet.root, 5)
        revision = upstream.manifest(MODEL).revision
        assert revision != old
        hashes = upstream.block_hashes(MODEL, revision)  # digests the storage revision there
        assert len(hashes["w"]) == 4 and hashes["empty"] == ()
        assert upstream.manifest(MODEL, revision=revision).digest  # the digest, once hashed
        got = b"".join(block.data for block in upstream.revision_blocks(MODEL, revision, ["w", "b"]))
        expected = b"".join(state[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for name in "wb")
        assert got == expected
        for names in ([FILE], [".."], ["../../etc/passwd"], [str(fleet.root / MODEL / FILE)], ["w", FILE]):
            with pytest.raises(NotFoundError):
                list(upstream.revision_blocks(MODEL, revision, names))
        with pytest.raises(NotFoundError):
            list(upstream.revision_blocks(MODEL, old, ["w"]))  # its files are gone
        with pytest.raises(NotFoundError):
            upstream.block_hashes(MODEL, old)
        with pytest.raises(InvalidArgumentError):
            list(upstream.revision_blocks(MODEL, "../" + revision, ["w"]))
        with pytest.raises(InvalidArgumentError):
            list(upstream.revision_blocks(MODEL, revision, ["w", "w"]))


def test_a_sidecar_serves_peers_only_its_current_storage_revisions_tensors_from_its_disk_cache(fleet: Fleet) -> None:
    with WeightStreamClient(fleet.sidecar_target, progress=False) as near:
        near.manifest(MODEL)
        old = near.manifest(MODEL).revision
        revision, state = _new_revision(fleet, 6)
        got = b"".join(block.data for block in near.revision_blocks(MODEL, revision, ["b", "w"]))
        assert got == b"".join(state[n].contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n in "bw")
        for names in ([FILE], [".."], ["/etc/passwd"]):
            with pytest.raises(NotFoundError):
                list(near.revision_blocks(MODEL, revision, names))
        with pytest.raises(NotFoundError):
            list(near.revision_blocks(MODEL, old, ["w"]))
        with pytest.raises(NotFoundError):  # a model it does not follow
            list(near.revision_blocks("other-model", revision, ["w"]))


def test_without_fanout_upstream_a_storage_revision_reaches_the_sidecar_the_usual_way(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    _write(root, 0)
    with serving(loopback_settings(model_root=root, watch_interval=0.2)) as upstream:
        side = loopback_settings(
            upstream=f"{LOOPBACK}:{upstream.port}", peers=True, disk_cache=tmp_path / "cache", watch_interval=0.2
        )
        with serving(side) as sidecar, WeightStreamClient(f"{LOOPBACK}:{sidecar.port}", progress=False) as near:
            caplog.set_level(logging.WARNING, logger="weightstream_server.revisions.relay")
            near.manifest(MODEL)
            state = _write(root, 7)
            with WeightStreamClient(f"{LOOPBACK}:{upstream.port}", progress=False) as client:
                revision = client.manifest(MODEL).revision
            eventually(lambda: near.manifest(MODEL).revision == revision, "the new revision", timeout=20.0)
            loaded = near.load_state_dict(MODEL)
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    assert any("not taken through peers" in r.getMessage() for r in caplog.records)


def test_while_a_storage_revision_is_pulled_from_peers_clients_are_answered_with_the_revision_held(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upstream's blocks of the new revision come slowly (0.4 s each here, as a slow link): meanwhile a
    client of the sidecar is answered at once with the revision the sidecar holds, its files read from the
    disk cache, not sent to wait for files still being written; once they are kept, the new revision."""
    served = threading.Event()
    block = StoredBlocks.block

    def slow_block(self: StoredBlocks, model: str, revision: str, tensor: str, index: int) -> bytes | None:
        served.set()
        time.sleep(0.4)
        return block(self, model, revision, tensor, index)

    with WeightStreamClient(fleet.sidecar_target, progress=False) as near:
        old = near.manifest(MODEL).revision
        held = {name: torch.empty_like(tensor) for name, tensor in _write_state(0).items()}
        near.load_into(held, MODEL, strict=False)  # the held revision's file in the sidecar's disk cache
        monkeypatch.setattr(StoredBlocks, "block", slow_block)
        state = _write(fleet.root, 7)
        assert served.wait(20.0), "the sidecar's pull never asked the upstream for a block"
        started = time.monotonic()
        assert near.manifest(MODEL).revision == old
        views = {name: torch.empty_like(tensor) for name, tensor in held.items()}
        near.load_into(views, MODEL, revision=old, strict=False)
        assert time.monotonic() - started < 1.0  # the pull takes four blocks of 0.4 s
        assert all(torch.equal(views[name], held[name]) for name in views)
        revision, _ = _new_revision(fleet, 7)
        assert revision != old
        near.load_into(views, MODEL, revision=revision, strict=False)
    assert all(torch.equal(views[name], state[name]) for name in views)


def _write_state(seed: int) -> dict[str, torch.Tensor]:
    """The tensors _write(root, seed) writes, without writing them."""
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 * MIB // 4 + 5, generator=generator), "b": torch.randn(10, generator=generator)}


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_placement_on_a_full_filesystem_fails_cleanly_and_marks_the_disk_cache_unwritable(tmp_path: Path) -> None:
    """A disk cache whose budget is larger than its filesystem's free space (a 4 MiB tmpfs here): a placement
    of an 8 MiB file fails at buffer() with UNAVAILABLE, before any write into its map (which would end the
    process with SIGBUS), leaves no partial file, and the cache is not written a while."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        cache = DiskCache(small / "cache", 1 << 30)
        file = SourceFile(FILE, f"upstream://{MODEL}/{FILE}", 8 * MIB, "v1")
        placement = cache.place(file)
        assert placement is not None
        with pytest.raises(StorageUnavailable, match="no room"):
            placement.buffer()
        assert os.listdir(small / "cache" / "partial") == []
        assert cache.place(file) is None  # not written a while, as after a fill's failed write
    finally:
        # Lazily: the cache's lock file and the dropped placement's descriptor close when collected.
        subprocess.run(["umount", "--lazy", str(small)], check=True)
