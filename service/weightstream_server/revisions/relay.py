"""A tier's revisions are its upstream's (--upstream): the models it reads from there are followed.

Each model that clients ask this server for and that it reads from its upstream gets a follower: a
thread holding the upstream's WatchModel. Every revision the watch reports becomes this server's
too, under the same name, so a client pinned to a revision may ask either tier:

- a storage revision: the model's files are listed anew. While the watch is held the listing is
  kept (storage.upstream.UpstreamSource.hold_listings), so a manifest costs no call to the
  upstream: one ListModelFiles per revision, not one per request.
  With --peers and a disk cache, the revision's files that the disk cache lacks are first written
  into it from the blocks of the peer the watch event names (revisions.storage_pull), so that the
  upstream's link carries about one copy for the whole fleet; where that fails (no disk cache, an
  upstream without --fanout, a lying upstream) the files are read from the upstream as they are asked for.
- a published revision: taken into this server's memory as a published revision
  (Publisher.relay, within --publish-max-bytes). Tensors that did not change since the published
  revision this server holds are shared with it: the new revision refers to the same memory (no
  copy, no memory of its own). Changed tensors get memory of their own: their unchanged blocks are
  copied from the revision held here (a published revision's memory, or files in the disk cache),
  and only the changed byte ranges (GetChanges: the upstream's block CRC32Cs) are asked of the
  upstream, over its data port where it has one. Anything this server cannot copy (no held bytes,
  another layout, a since the upstream no longer keeps) is pulled whole. With --peers the changed
  tensors come as blocks from the peer the watch event names (revisions.peer_pull): the blocks whose
  upstream hash equals the held published revision's are copied from it, and the others may come
  as deltas against it.

The first request for a model waits, up to FIRST_REVISION_S, for its follower to take the
upstream's current revision, so that it is answered with that one. A watch that ends (the
upstream restarted, the network cut) is held again after RETRY_S, doubling up to MAX_RETRY_S while
it fails; meanwhile listings are not kept (each manifest asks the upstream, as without a follower).
A watch refused for good (no watch slot left there, no permission) ends the follower: the model is
served as without one, and a request after REST_S tries again; for a model the upstream does not
have, the next request does (it may be published meanwhile). At most MAX_FOLLOWED models are
followed at once (an upstream gives each client half its --max-watches).

Concurrency: one thread per followed model; every method may be called from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
import torch

from weightstream.client import WeightStreamClient
from weightstream.client.errors import WeightStreamError
from weightstream.client.manifest import Manifest as UpstreamManifest
from weightstream.client.manifest import TensorInfo
from weightstream.client.revisions import RevisionEvent
from weightstream.protocol import dtypes
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import ModelNotFound, ServerError, UpstreamError
from weightstream_server.revisions.peer_blocks import Holdings
from weightstream_server.revisions.peer_pull import Held, HeldTensor, PullReport, pull_blocks
from weightstream_server.revisions.published import Known, Publisher
from weightstream_server.revisions.published_source import PublishedSource, Shared
from weightstream_server.revisions.storage_pull import StoragePull
from weightstream_server.revisions.store import PUBLISHED, RevisionStore
from weightstream_server.serving.catalog import Catalog, Manifest
from weightstream_server.serving.deltas import ChunkKey, Delta
from weightstream_server.settings import ServerSettings
from weightstream_server.storage.model_ids import check_revision_name
from weightstream_server.storage.open_files import OpenFiles, read_exactly
from weightstream_server.storage.tiers import TieredSource
from weightstream_server.storage.upstream import UpstreamSource, peer_client, upstream_client

logger = logging.getLogger(__name__)

# How long the first request for a model waits for its follower to take the upstream's revision.
FIRST_REVISION_S = 120.0
# How long a follower whose watch ended waits before it holds the watch again: RETRY_S, doubling
# while it keeps failing, up to MAX_RETRY_S.
RETRY_S = 1.0
MAX_RETRY_S = 30.0
# How long a model whose watch was refused for good is served without a follower, and how many such
# models are remembered.
REST_S = 60.0
MAX_RESTING = 1024
# Models followed at once.
MAX_FOLLOWED = 16
# Watch failures that will not pass by themselves: the follower ends.
_FINAL = {
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNIMPLEMENTED,
}


@dataclass
class _Follower:
    model: str
    source: UpstreamSource
    # Set once the first revision was taken (or the watch failed): the first request may go on.
    ready: threading.Event = field(default_factory=threading.Event)


@dataclass
class RelayCounts:
    """What the relay did, for /status and the tests."""

    revisions: int = 0
    # Bytes of relayed revisions asked of the upstream, copied from revisions held here (files in the
    # disk cache, changed tensors' unchanged blocks), and shared with a kept published revision.
    pulled_bytes: int = 0
    copied_bytes: int = 0
    shared_bytes: int = 0
    seconds: float = 0.0


class Relay:
    """Followers of the upstream's revisions, one per model asked for."""

    def __init__(
        self,
        settings: ServerSettings,
        store: RevisionStore,
        catalog: Catalog,
        publisher: Publisher,
        holdings: Holdings | None = None,
    ) -> None:
        self._settings = settings
        # Fleet fan-out (--peers): published revisions' blocks come from the peer each watch event
        # names, and this server's pulls are served to its own peers (revisions.peer_pull).
        self._holdings = holdings if settings.peers else None
        # The gRPC port this server serves peers on (set once bound; 0: not serving peers).
        self.peer_port = 0
        # False once the upstream answered UNIMPLEMENTED (no --fanout there): revisions it plans no
        # peer for are pulled the way without peers, until an event names a peer again.
        self._upstream_fans_out = True
        self._store = store
        self._catalog = catalog
        self._publisher = publisher
        self._client = upstream_client(settings, "auto")
        self._lock = threading.Lock()
        self._followers: dict[str, _Follower] = {}
        self._stop = threading.Event()
        # Models whose watch was refused for good, and when: not followed again before REST_S.
        self._resting: dict[str, float] = {}
        self._warned_full = False
        self.counts = RelayCounts()
        store.on_asked.append(self.follow)

    @property
    def transport(self) -> str:
        """How revisions come from the upstream: tcp (its data port), shm or grpc."""
        return self._client.transport

    def followed(self) -> list[str]:
        with self._lock:
            return sorted(self._followers)

    def follow(self, model: str, revision: str = "") -> None:
        """Follow model if it is read from the upstream; the first time, wait for its current revision.

        A request that names a revision not here yet, which is the upstream's current one (published
        there a moment ago), waits for the follower to take it, up to FIRST_REVISION_S.
        """
        with self._lock:
            follower = self._followers.get(model)
        if follower is None:
            follower = self._start(model)
            if follower is None:
                return
        if not follower.ready.is_set() and not follower.ready.wait(FIRST_REVISION_S):
            logger.warning(
                "model %r: the upstream's revision did not arrive within %.0f s; answering with the one held here",
                model,
                FIRST_REVISION_S,
            )
        if not revision or self._store.find(model, revision) is not None:
            return
        try:
            current = self._client.manifest(model).revision
        except WeightStreamError:
            return  # the request is answered with what this server has
        if current == revision and not self._store.wait_for(model, revision, FIRST_REVISION_S):
            logger.warning(
                "model %r: revision %s of the upstream did not arrive within %.0f s", model, revision, FIRST_REVISION_S
            )

    def close(self) -> None:
        self._stop.set()
        self._client.close()  # ends every watch in flight

    def _start(self, model: str) -> _Follower | None:
        source = self._upstream_of(model)
        if source is None or self._stop.is_set():
            return None
        with self._lock:
            follower = self._followers.get(model)
            if follower is not None:
                return follower
            refused = self._resting.get(model)
            if refused is not None and time.monotonic() - refused < REST_S:
                return None
            if len(self._followers) >= MAX_FOLLOWED:
                if not self._warned_full:
                    logger.warning(
                        "following %d models of the upstream already; model %r is listed at each request",
                        MAX_FOLLOWED,
                        model,
                    )
                    self._warned_full = True
                return None
            follower = _Follower(model, source)
            self._followers[model] = follower
        threading.Thread(
            target=self._run, args=(follower,), name=f"weightstream-follow-{model[:40]}", daemon=True
        ).start()
        return follower

    def _upstream_of(self, model: str) -> UpstreamSource | None:
        try:
            source = self._catalog.source_for(model)
        except ServerError:
            return None
        if isinstance(source, TieredSource) and isinstance(source.inner, UpstreamSource):
            return source.inner
        return None

    def _run(self, follower: _Follower) -> None:
        model = follower.model
        delay = RETRY_S
        try:
            while not self._stop.is_set():
                follower.source.hold_listings(model, True)
                try:
                    peer_port = self.peer_port if self._holdings is not None else 0
                    for event in self._client.watch(model, peer_port=peer_port):
                        self._take(follower, event)
                        follower.ready.set()
                        delay = RETRY_S
                except WeightStreamError as exc:
                    if self._stop.is_set():
                        return
                    if exc.code in _FINAL:
                        logger.info("model %r: not following the upstream's revisions: %s", model, exc.message)
                        if exc.code != grpc.StatusCode.NOT_FOUND:  # a model not there yet may be published soon
                            self._rest(model)
                        return
                    log = logger.warning if delay == RETRY_S else logger.debug
                    log("model %r: the upstream's watch ended (%s); held again in %.0f s", model, exc.message, delay)
                finally:
                    follower.source.hold_listings(model, False)
                    follower.ready.set()
                self._stop.wait(delay)
                delay = min(2 * delay, MAX_RETRY_S)
        finally:
            with self._lock:
                self._followers.pop(model, None)

    def _rest(self, model: str) -> None:
        with self._lock:
            self._resting[model] = time.monotonic()
            while len(self._resting) > MAX_RESTING:
                self._resting.pop(next(iter(self._resting)))

    def _take(self, follower: _Follower, event: RevisionEvent) -> None:
        """Make the upstream's revision event.revision this server's current one.

        What the event names is the upstream's word: a watch event for another model is dropped, a
        revision name that a publisher could not give is refused, and a published revision that is no
        longer the upstream's current one is skipped (the watch reports the newer one next), so a
        sidecar takes the latest revision, not each one.
        """
        model = follower.model
        if event.model != model:
            logger.warning(
                "model %r: the upstream's watch reported model %r; the event is dropped", model, event.model[:200]
            )
            return
        try:
            check_revision_name(model, event.revision, "the upstream's watch")
        except ServerError as exc:
            logger.warning("model %r: %s; the event is dropped", model, exc)
            return
        if event.origin != PUBLISHED:
            # The listing kept (the revision held here) is dropped only once the files are in the disk
            # cache: meanwhile clients are answered with the revision held, not sent to wait for files
            # still being written from peers.
            files = self._take_files(model, event.revision, event.peer)
            follower.source.forget_listing(model)
            try:
                self._store.observe_storage(model, self._catalog.storage_manifest(model))
            except ServerError as exc:
                logger.warning("model %r: storage revision %s of the upstream: %s", model, event.revision, exc)
            finally:
                if files is not None:
                    files.close()  # its peers are served from the files in the disk cache from now on
            return
        if self._store.find(model, event.revision) is not None:
            return
        if self._holdings is not None:
            self._holdings.expect(model, event.revision)  # peers planned below this one may ask already
        try:
            current = self._client.manifest(model).revision
            if current != event.revision:
                logger.debug(
                    "model %r: revision %s of the upstream is not its current one (%s); skipped",
                    model,
                    event.revision,
                    current[:200],
                )
                return
            if self._store.current(model) is None:
                # The model's files first (if it has any): seen after the published revision, they
                # would count as a newer storage revision and take its place.
                self._observe_storage(model)
            self._pull(model, event.revision, event.peer)
        except (ServerError, WeightStreamError) as exc:
            logger.warning("model %r: published revision %s of the upstream not taken: %s", model, event.revision, exc)

    def _note_no_fanout(self, exc: BaseException, then: str) -> None:
        """After exc: an upstream that answered UNIMPLEMENTED serves no fan-out (no --fanout there), so
        revisions it plans no peer for are taken the way without peers (then says how)."""
        if isinstance(exc, WeightStreamError) and exc.code == grpc.StatusCode.UNIMPLEMENTED:
            self._upstream_fans_out = False
            logger.info("upstream %s serves no fan-out (no --fanout there): %s", self._client.target, then)

    def follows(self, model: str) -> bool:
        """Whether model's revisions are followed from the upstream now (its storage revisions' blocks may be
        served to peers from the disk cache)."""
        with self._lock:
            return model in self._followers

    def _take_files(self, model: str, revision: str, parent: str) -> StoragePull | None:
        """Write storage revision's files that the disk cache lacks from parent's blocks (a peer the upstream
        planned; "" for the upstream itself): the pull, still serving this server's peers until closed; None
        where the peer path is off here or failed (the files are then read from the upstream as asked for)."""
        holdings = self._holdings
        if holdings is None:
            return None
        try:
            tier = self._catalog.source_for(model)
        except ServerError:
            return None
        if not isinstance(tier, TieredSource) or tier.cache is None:
            return None
        if parent:
            self._upstream_fans_out = True
        if not self._upstream_fans_out:
            return None
        started = time.perf_counter()

        def connect(target: str) -> WeightStreamClient:
            return peer_client(self._settings, target)

        pull = StoragePull(
            tier,
            holdings,
            self._client,
            connect,
            model,
            revision,
            parent,
            self._settings.peer_stall_seconds,
            self._settings.peer_min_rate,
        )
        try:
            pull.run()
        except Exception as exc:  # whatever failed, the way without peers still works
            pull.close()
            self._note_no_fanout(exc, "storage revisions are read from it")
            logger.warning(
                "model %r: storage revision %s not taken through peers (%s); its files are read from the upstream",
                model,
                revision,
                exc,
            )
            return None
        report = pull.report
        if report is not None:
            holdings.counts.add(peer_bytes=report.peer_bytes, upstream_bytes=report.upstream_bytes)
            with self._lock:
                self.counts.pulled_bytes += report.peer_bytes + report.upstream_bytes + pull.around_bytes
        logger.info(
            "model %r: storage revision %s: %d files into the disk cache, %d bytes from peer %s, %d from the "
            "upstream (%d of them headers and gaps), %.3f s",
            model,
            revision,
            pull.files,
            report.peer_bytes if report is not None else 0,
            parent or "(none)",
            (report.upstream_bytes if report is not None else 0) + pull.around_bytes,
            pull.around_bytes,
            time.perf_counter() - started,
        )
        return pull

    def _observe_storage(self, model: str) -> None:
        try:
            self._store.observe_storage(model, self._catalog.storage_manifest(model))
        except (ModelNotFound, UpstreamError) as exc:
            if isinstance(exc, UpstreamError) and exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            # A model only published upstream: no files.

    def _held(self, model: str) -> Manifest | None:
        """The manifest of the revision this server holds of model, as it can be read now (a storage
        revision's files may have reached the disk cache since it was first listed); None if none."""
        held = self._store.current(model)
        if held is None or not held.servable:
            return None
        if held.origin == PUBLISHED:
            return held.manifest
        try:
            now = self._catalog.storage_manifest(model)
        except ServerError:
            return None
        return now if now.revision == held.id else None

    def _pull(self, model: str, revision: str, parent: str = "") -> None:
        if parent:
            self._upstream_fans_out = True
        if self._holdings is not None and self._upstream_fans_out:
            try:
                self._pull_from_peers(model, revision, parent)
                return
            except (ServerError, WeightStreamError) as exc:
                self._holdings.forget(model, revision)
                self._note_no_fanout(exc, "revisions are pulled from it whole")
                # An upstream without the fan-out RPCs, or one that failed them: the way without peers.
                logger.warning(
                    "model %r: revision %s not taken through peers (%s); pulled from the upstream", model, revision, exc
                )
        started = time.perf_counter()
        upstream, held, shared, start = self._begin(model, revision)
        pulled = copied = 0
        shared_bytes = sum(s.nbytes for s in shared.values())
        # The deltas from held to revision the upstream sent, checked: served here as they came.
        # (within --delta-cache-bytes: a hostile upstream cannot make this grow past it)
        deltas: dict[ChunkKey, Delta] = {}
        kept_bytes = 0

        def keep(tensor: str, offset: int, length: int, encoding: int, payload: bytes) -> None:
            nonlocal kept_bytes
            if kept_bytes + len(payload) <= self._publisher.deltas_budget:
                deltas[(tensor, offset, length)] = (encoding, payload)
                kept_bytes += len(payload)

        def fill(views: dict[str, torch.Tensor]) -> None:
            nonlocal pulled, copied
            copies: set[str] = set()
            if held is not None:
                try:
                    copies = _copy_held(held, views)
                except (OSError, EOFError, ServerError) as exc:  # its files went: all of it from the upstream
                    logger.warning("model %r: revision %s held here could not be copied: %s", model, held.revision, exc)
            rest = {name: view for name, view in views.items() if name not in copies}
            if copies:
                assert held is not None
                try:
                    report = self._client.update_into(
                        {name: views[name] for name in copies},
                        model,
                        since=held.revision,
                        revision=revision,
                        strict=False,
                        delta_sink=keep,
                    )
                    pulled += report.bytes
                    copied += sum(views[n].numel() * views[n].element_size() for n in copies) - report.bytes
                except WeightStreamError as exc:
                    if exc.code != grpc.StatusCode.NOT_FOUND:
                        raise
                    deltas.clear()  # what they stood for is pulled again whole: not this revision's bytes
                    rest = views  # the upstream no longer keeps the revision held here: all of it
            if rest:
                pulled += self._client.load_into(rest, model, revision=revision, strict=False).bytes

        order = [info.name for info in upstream.tensors]
        self._publisher.relay(start, fill, f"upstream {self._client.target}", list(shared.values()), order)
        if held is not None:
            self._publisher.keep_deltas(model, held.revision, revision, deltas)
        seconds = time.perf_counter() - started
        with self._lock:
            self.counts.revisions += 1
            self.counts.pulled_bytes += pulled
            self.counts.copied_bytes += copied
            self.counts.shared_bytes += shared_bytes
            self.counts.seconds += seconds
        logger.info(
            "model %r: revision %s relayed from the upstream: %d bytes pulled (%d chunks as deltas, kept to serve), "
            "%d copied and %d shared from %s, %.3f s",
            model,
            revision,
            pulled,
            len(deltas),
            copied,
            shared_bytes,
            held.revision if held is not None else "nothing",
            seconds,
        )

    def _begin(
        self, model: str, revision: str
    ) -> tuple[UpstreamManifest, Manifest | None, dict[str, Shared], pb.PublishStart]:
        """revision's manifest from the upstream, what this server holds of model, the tensors revision
        shares with it, and the PublishStart of the others (those to pull)."""
        upstream = self._client.manifest(model, revision=revision)
        held = self._held(model)
        shared = self._shared(model, held, upstream.tensors, revision)
        start = pb.PublishStart(model=model, revision=revision, new_layout=True)
        for info in upstream.tensors:
            if info.name not in shared:
                start.tensors.append(
                    pb.PublishedTensor(name=info.name, dtype=dtypes.BY_TORCH[info.dtype].wire, shape=list(info.shape))
                )
        return upstream, held, shared, start

    def _pull_from_peers(self, model: str, revision: str, parent: str) -> None:
        """Take revision as the blocks of its changed tensors from parent (a peer the upstream planned;
        "" for the upstream itself), each checked against the upstream's block hashes; the blocks the
        published revision held here has unchanged are copied from it, and the others may come as
        deltas against it."""
        holdings = self._holdings
        assert holdings is not None
        started = time.perf_counter()
        upstream, held_manifest, shared, start = self._begin(model, revision)
        held = self._held_blocks(model, held_manifest, upstream.tensors)
        order = [info.name for info in upstream.tensors]
        reports: list[PullReport] = []

        def connect(target: str) -> WeightStreamClient:
            return peer_client(self._settings, target)

        def fill(views: dict[str, torch.Tensor]) -> Known:
            names = [name for name in order if name in views]
            stall_s = self._settings.peer_stall_seconds
            min_rate = self._settings.peer_min_rate
            reports.append(
                pull_blocks(holdings, self._client, connect, upstream, views, names, parent, stall_s, min_rate, held)
            )
            return reports[-1].known

        try:
            self._publisher.relay(start, fill, f"peers of {self._client.target}", list(shared.values()), order)
        finally:
            for report in reports:
                if report.pull is not None:
                    holdings.end(report.pull)
        holdings.forget(model, revision)
        report = reports[0]
        holdings.counts.add(
            peer_bytes=report.peer_bytes,
            upstream_bytes=report.upstream_bytes,
            copied_bytes=report.copied_bytes,
            peer_wire_bytes=report.peer_wire_bytes,
            upstream_wire_bytes=report.upstream_wire_bytes,
        )
        seconds = time.perf_counter() - started
        shared_bytes = sum(s.nbytes for s in shared.values())
        with self._lock:
            self.counts.revisions += 1
            self.counts.pulled_bytes += report.peer_bytes + report.upstream_bytes
            self.counts.copied_bytes += report.copied_bytes
            self.counts.shared_bytes += shared_bytes
            self.counts.seconds += seconds
        logger.info(
            "model %r: revision %s relayed: %d bytes from peer %s (%d on the wire), %d from the upstream "
            "(%d on the wire), %d blocks as deltas, %d copied and %d shared from %s, %.3f s",
            model,
            revision,
            report.peer_bytes,
            parent or "(none)",
            report.peer_wire_bytes,
            report.upstream_bytes,
            report.upstream_wire_bytes,
            report.delta_blocks,
            report.copied_bytes,
            shared_bytes,
            held.revision if held is not None else "nothing",
            seconds,
        )

    def _held_blocks(self, model: str, held: Manifest | None, tensors: Sequence[TensorInfo]) -> Held | None:
        """The published revision held here in memory, with its block checks, as a pull copies blocks from
        it (its tensors of the same dtype and shape as tensors'); None where there is none."""
        if held is None or not isinstance(held.source, PublishedSource):
            return None
        kept = self._store.find(model, held.revision)
        if kept is None or kept.blocks is None or kept.block_hashes is None:
            return None
        found: dict[str, HeldTensor] = {}
        for info in tensors:
            entry = held.by_name.get(info.name)
            crcs = kept.blocks.get(info.name)
            hashes = kept.block_hashes.get(info.name)
            if entry is None or crcs is None or hashes is None:
                continue
            if entry.dtype.torch != info.dtype or entry.shape != tuple(info.shape):
                continue
            part = held.source.part_buffer(entry.file_index)
            flat = part[entry.file_offset : entry.file_offset + entry.nbytes]
            found[info.name] = HeldTensor(flat, crcs, hashes)
        return Held(held.revision, found) if found else None

    def _shared(
        self, model: str, held: Manifest | None, tensors: Sequence[TensorInfo], revision: str
    ) -> dict[str, Shared]:
        """The tensors of revision that did not change since held, a published revision in memory here:
        held by reference in the new revision (no copy, no memory of its own). None where held is
        not in memory, or the upstream cannot say what changed since it."""
        if held is None or not isinstance(held.source, PublishedSource):
            return {}
        kept = self._store.find(model, held.revision)
        if kept is None or kept.blocks is None:
            return {}
        try:
            changed = self._client.changes(model, since=held.revision, revision=revision).tensors
        except WeightStreamError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            return {}  # the upstream no longer keeps the revision held here
        shared: dict[str, Shared] = {}
        for info in tensors:
            entry = held.by_name.get(info.name)
            blocks = kept.blocks.get(info.name)
            hashed = kept.tensor_hashes.get(info.name) if kept.tensor_hashes is not None else None
            if entry is None or blocks is None or hashed is None or info.name in changed:
                continue
            if entry.dtype.torch != info.dtype or entry.shape != tuple(info.shape):
                continue
            buffer = held.source.part_buffer(entry.file_index)
            block_hashes = kept.block_hashes.get(info.name) if kept.block_hashes is not None else None
            shared[info.name] = Shared(
                info.name,
                entry.dtype,
                entry.shape,
                entry.nbytes,
                buffer,
                entry.file_offset,
                blocks,
                hashed,
                block_hashes,
            )
        return shared


def _copy_held(held: Manifest, views: dict[str, torch.Tensor]) -> set[str]:
    """Copy the tensors of views that held has (same dtype and shape) in memory or local files into
    them; the names copied."""
    copied: set[str] = set()
    source = held.source
    local = {i for i, f in enumerate(held.files) if f.local is not None}
    opened = OpenFiles(source, held.model, {i: held.files[i] for i in local}) if local else None
    try:
        for name, view in views.items():
            entry = held.by_name.get(name)
            if entry is None or entry.dtype.torch != view.dtype or entry.shape != tuple(view.shape):
                continue
            flat = view.view(-1).view(torch.uint8)
            if isinstance(source, PublishedSource):
                part = source.part_buffer(entry.file_index)
                flat.copy_(part[entry.file_offset : entry.file_offset + entry.nbytes])
            elif opened is not None and entry.file_index in local:
                read_exactly(opened.fd(entry.file_index), flat.numpy().data, entry.file_offset)
            else:
                continue
            copied.add(name)
        if opened is not None:
            opened.check_all_unchanged()
    finally:
        if opened is not None:
            opened.close()
    return copied
