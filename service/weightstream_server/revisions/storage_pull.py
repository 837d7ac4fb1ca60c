"""Fleet fan-out of storage revisions, the puller's side: a revision's files written into the disk cache from peers.

A sidecar with --peers and a disk cache, told of a storage revision of a model it follows from its
upstream, writes each safetensors file of that revision its disk cache lacks (a file of the same
version already there is not pulled again) in place (storage.disk_cache.Placement):

- the header, and any byte outside a tensor (between tensors, after the last), from the upstream
  itself, over this server's own connection (a ranged read, as a fill's), the last read running to
  the file's end so that it carries the upstream's CRC32C of the whole file;
- the tensors' bytes as the revision's blocks through peer_pull.pull_blocks from the peer the
  upstream planned (or the upstream), straight into the file being written: each block checked
  against the upstream's BLAKE3 block hashes (themselves checked against the digest of the
  upstream's manifest of the revision), the rest from the upstream where the peer fails.

A file is kept only once whole and checked as a fill is (its size and that whole-file CRC32C); if
anything fails, every file of the pull not yet kept is dropped (streams waiting for it are told to
try again and read it the usual way) and the caller takes the revision the way without peers. While it
pulls, its blocks are served to this server's own peers (peer_blocks.Pull); once the revision is
current here, from the kept files (revisions.stored_blocks).

Memory: each file being written is mapped (Placement.buffer); the tensors' views into those maps are
this pull's, and its Pull, which peers read from, is closed before the maps are (close()).

Concurrency: one pull runs on its caller's thread (a follower's), with pull_blocks' watchdog; close()
comes after run() on the same thread.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable

import grpc
import torch

from weightstream.client import WeightStreamClient
from weightstream.client.manifest import Manifest
from weightstream_server.errors import UpstreamError
from weightstream_server.revisions.peer_blocks import Holdings
from weightstream_server.revisions.peer_pull import LIED, PullReport, pull_blocks
from weightstream_server.storage.disk_cache import Placement
from weightstream_server.storage.header import HeaderTensor, read_header
from weightstream_server.storage.sources import SourceFile
from weightstream_server.storage.sources import revision as revision_of
from weightstream_server.storage.tiers import TieredSource
from weightstream_server.storage.upstream import UpstreamSource

logger = logging.getLogger(__name__)


class StoragePull:
    """One storage revision of one model, its missing files written into tier's disk cache from peers' blocks."""

    def __init__(
        self,
        tier: TieredSource,
        holdings: Holdings,
        upstream: WeightStreamClient,
        connect: Callable[[str], WeightStreamClient],
        model: str,
        revision: str,
        parent: str,
        stall_s: float,
        min_rate: float = 0.0,
    ) -> None:
        assert tier.cache is not None
        self._tier = tier
        self._holdings = holdings
        self._upstream = upstream
        self._connect = connect
        self.model = model
        self.revision = revision
        self.parent = parent
        self._stall_s = stall_s
        self._min_rate = min_rate
        self._placements: list[tuple[Placement, int]] = []  # each with the upstream's whole-file CRC32C
        self._views: dict[str, torch.Tensor] = {}
        self.report: PullReport | None = None
        # Files written here and kept, and bytes read from the upstream around the tensors (headers, gaps).
        self.files = 0
        self.around_bytes = 0

    def run(self) -> None:
        """Write the revision's missing files into the disk cache; raises (nothing unchecked kept) if that fails."""
        model, revision = self.model, self.revision
        cache = self._tier.cache
        assert cache is not None
        # Peers planned below this one may ask already: their requests wait for this pull (peer_blocks),
        # and for the revision to be current here (close()).
        self._holdings.expect(model, revision)
        inner = self._tier.inner
        # Listed anew for the pull only: until the revision is taken here, this server answers with the
        # revision it holds (whose files its disk cache has), not with files still being written.
        located = inner.list_anew(model) if isinstance(inner, UpstreamSource) else inner.resolve(model)
        listed = revision_of(located.files)
        if listed != revision:
            raise UpstreamError(
                f"model {model!r}: the upstream lists storage revision {listed}, not {revision}",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        missing = [f for f in located.files if cache.lookup(f) is None]
        if not missing:
            return
        self._upstream.block_hashes(model, revision)  # digests the revision there, so that its manifest has the digest
        manifest = self._upstream.manifest(model, revision=revision)
        for file in missing:
            placement = cache.place(file)
            if placement is None:
                continue  # being filled already, or it does not fit: read the usual way
            self._placements.append((placement, 0))
            whole = self._prepare(file, placement, manifest)
            self._placements[-1] = (placement, whole)
        if not self._placements:
            return
        names = [info.name for info in manifest.tensors if info.name in self._views]
        self.report = pull_blocks(
            self._holdings,
            self._upstream,
            self._connect,
            manifest,
            self._views,
            names,
            self.parent,
            self._stall_s,
            self._min_rate,
        )
        for placement, whole in self._placements:
            placement.keep(whole)
            self.files += 1

    def close(self) -> None:
        """End the pull (its peers read no more of it here, but from the kept files once the revision is current),
        drop the files not kept, unmap them all."""
        self._holdings.forget(self.model, self.revision)
        report = self.report
        if report is not None and report.pull is not None:
            self._holdings.end(report.pull)
            report.pull = None
        self._views.clear()
        for placement, _ in self._placements:
            placement.discard()
            placement.close_buffer()
        self._placements.clear()

    def _prepare(self, file: SourceFile, placement: Placement, manifest: Manifest) -> int:
        """Write file's bytes outside its tensors from the upstream into placement, add its tensors' views;
        the upstream's CRC32C of the whole file."""
        what = f"model {self.model!r}: file {file.name!r}"
        pieces: list[tuple[int, bytes]] = []

        def read(start: int, length: int) -> bytes:
            data = b"".join(data for data, _ in self._tier.read_uncached(file, start, length))
            pieces.append((start, data))
            return data

        tensors = read_header(read, file.size, what)
        _check_against(what, tensors, manifest, file.name)
        buffer = placement.buffer()
        for start, data in pieces:
            buffer[start : start + len(data)] = data
        # The bytes between the header and the tensors, and between tensors (none in files as written
        # by safetensors, but a file may have them), then the tail to the end with the whole CRC32C.
        done = max(start + len(data) for start, data in pieces)
        for tensor in tensors:
            if tensor.start > done:
                self._copy_range(file, buffer, done, tensor.start)
            done = max(done, tensor.end)
        whole = self._copy_tail(file, buffer, done)
        flat = torch.frombuffer(buffer, dtype=torch.uint8)
        for tensor in tensors:
            self._views[tensor.name] = flat[tensor.start : tensor.end]
        return whole

    def _copy_range(self, file: SourceFile, buffer: mmap.mmap, start: int, end: int) -> None:
        done = start
        for data, _ in self._tier.read_uncached(file, start, end - start):
            _put(buffer, done, data, end, file.name)
            done += len(data)
        self.around_bytes += done - start
        if done != end:
            raise UpstreamError(f"{file.path}: the upstream sent {done - start} of {end - start} bytes", LIED)

    def _copy_tail(self, file: SourceFile, buffer: mmap.mmap, start: int) -> int:
        """Copy file's bytes from start to its end (at least its last byte is read, which then lies in a tensor
        and is not written: a peer's checked block is); the whole-file CRC32C on the read's last piece."""
        at = min(start, file.size - 1)
        whole: int | None = None
        for data, crc in self._tier.read_uncached(file, at):
            if at >= start:
                _put(buffer, at, data, file.size, file.name)
            at += len(data)
            whole = crc if crc is not None else whole
        self.around_bytes += at - min(start, file.size - 1)
        if at != file.size or whole is None:
            raise UpstreamError(f"{file.path}: the upstream's read to the end gave no whole-file CRC32C", LIED)
        return whole


def _put(buffer: mmap.mmap, at: int, data: bytes, end: int, name: str) -> None:
    if at + len(data) > end:
        raise UpstreamError(f"file {name!r}: the upstream sent more than was asked for", LIED)
    buffer[at : at + len(data)] = data


def _check_against(what: str, tensors: list[HeaderTensor], manifest: Manifest, file_name: str) -> None:
    """Raise UpstreamError unless the header's tensors are exactly manifest's tensors of file_name."""
    listed = {info.name for info in manifest.tensors if info.file == file_name}
    if {t.name for t in tensors} != listed:
        raise UpstreamError(f"{what}: its header and the upstream's manifest name other tensors", LIED)
    for tensor in tensors:
        info = manifest.by_name[tensor.name]
        if tensor.dtype.torch != info.dtype or tensor.shape != tuple(info.shape) or tensor.nbytes != info.nbytes:
            raise UpstreamError(f"{what}: tensor {tensor.name!r} differs between its header and the manifest", LIED)
