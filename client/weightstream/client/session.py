"""One load in flight: its streams, the checks on every chunk they place, and how a broken one resumes.

WeightStreamClient makes a LoadSession for each iter_tensors or load_into call and runs it once
(receive). The session cuts the load's tensors into one group per stream, runs each group as a
_Stream, checks every chunk (its tensor and bounds before it is placed, its CRC32C where it
landed, before it counts), and resumes a broken stream by asking for only what has not landed.

Threading: with one stream, everything runs on the caller's thread. With several, each _Stream
(its pending and partly landed tensors, its placers) runs on a worker thread of its own and is
touched by no other; destination() is called from those threads; completed destinations are
handed to the caller's thread, which yields them; the tally (retries, re-sent bytes) is locked.
A transport reads its call on a helper thread (transports/call_reader.py), so that a stream's
thread can give up on a call that does not end when cancelled. A stream's deltas for host memory are
decoded and applied on its Applier's threads (deltas.py); the stream's thread takes their results,
and an attempt that ends waits for those in flight before anything else touches their tensors.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc
from tqdm import tqdm

from weightstream.client.channels import Channels
from weightstream.client.deltas import APPLIER_THREADS, Applier, DeltaUnusable, apply_delta
from weightstream.client.deltas import ENCODINGS as DELTA_ENCODINGS
from weightstream.client.errors import (
    FailedPreconditionError,
    IntegrityError,
    WeightStreamError,
    from_rpc_error,
    translated,
)
from weightstream.client.manifest import Manifest, TensorInfo
from weightstream.client.placement import Destination, Placers
from weightstream.client.progress import byte_bar
from weightstream.client.retry import (
    IDLE,
    READY_WAIT_S,
    IdleWatchdog,
    Outage,
    RetryPolicy,
    decide_retry,
    status_of,
)
from weightstream.client.transports.base import ChunkRef, StreamCancel, Transport, TransportError
from weightstream.client.transports.call_reader import StreamAbandoned
from weightstream.protocol import wire
from weightstream.v1 import weightstream_pb2 as pb

logger = logging.getLogger(__name__)

# (tensor, offset, length, encoding, payload) of a delta chunk received and checked: what a tier keeps
# to serve the same delta to its own clients (revisions.relay).
DeltaSink = Callable[[str, int, int, int, bytes], None]

# The reason a StreamCancel carries when the load itself stopped a stream (another stream failed,
# or the caller stopped iterating).
STOPPED = "stopped"


@dataclass(frozen=True, kw_only=True)
class SessionConfig:
    """What a client's configuration says about every load it runs; one per client, shared by its sessions."""

    channels: Channels
    # The client's target as it was given, named in errors and log lines.
    target: str
    chunk_bytes: int
    streams: int
    # None: fail at the first error, no idle deadline (watchdog None too).
    retry: RetryPolicy | None
    watchdog: IdleWatchdog | None
    # The model's manifest as the server has it now, asked when a stream fails FAILED_PRECONDITION.
    current_manifest: Callable[[str], Manifest]


class LoadSession:
    """One load of infos' tensors (all of manifest's, or some) into destination(name).

    destination(name) returns the Destination that tensor's chunks are written into. Used once:
    receive() yields each destination as it completes; retries and resent_bytes count what the
    load's streams cost, complete once receive() is done.
    """

    def __init__(
        self,
        config: SessionConfig,
        manifest: Manifest,
        infos: dict[str, TensorInfo],
        destination: Callable[[str], Destination],
        landed: Mapping[str, list[tuple[int, int]]] | None = None,
        delta_base: str = "",
        delta_tensors: frozenset[str] = frozenset(),
        delta_sink: DeltaSink | None = None,
    ) -> None:
        self.config = config
        # Called with each delta chunk whose result checked (see DeltaSink).
        self.delta_sink = delta_sink
        self.manifest = manifest
        self.infos = infos
        self.destination = destination
        # Byte ranges of some tensors that their destinations hold already (an update's unchanged
        # ones): only the rest is asked for.
        self.landed = landed or {}
        # The revision that delta_tensors' destinations hold where their bytes are missing: the server
        # may send those as XOR deltas against it (deltas.py).
        self.delta_base = delta_base
        self.delta_tensors = delta_tensors if delta_base else frozenset()
        # Streams resumed after a failure that reached a server, and bytes received again that
        # had already landed.
        self.retries = 0
        self.resent_bytes = 0
        # Chunks that came as deltas and checked, their payload bytes, and those whose result
        # failed its check (asked for again, whole).
        self.delta_chunks = 0
        self.delta_bytes = 0
        self.delta_fallbacks = 0
        self._tally_lock = threading.Lock()

    def receive(self, *, description: str, progress: bool) -> Iterator[Destination]:
        """Stream infos' bytes into their destinations; yield each destination once it is complete.

        Every chunk is checked (known tensor and bounds before it is placed, CRC32C where it landed,
        before it counts), and the streams are checked to have delivered every byte of every
        tensor. With config.streams > 1 the tensors are split into that many groups of about equal
        bytes, each received on its own channel and thread; destinations are yielded here, on the
        caller's thread, as they complete. A broken stream is resumed (see _Stream.run). progress
        draws a bar named description. Errors are the client's exceptions.
        """
        total = sum(info.nbytes for info in self.infos.values())
        groups = split(self.infos, self.config.streams)
        with translated(self.config.target), byte_bar(total, description, progress) as bar:
            if len(groups) == 1:
                yield from _Stream(self, 0, groups[0], bar).run()
                return
            yield from self._receive_parallel(groups, bar)

    def _receive_parallel(self, groups: list[dict[str, TensorInfo]], bar: tqdm) -> Iterator[Destination]:
        """Run one stream per group on worker threads; relay their destinations and their first error."""
        done: queue.Queue[Destination | BaseException | None] = queue.Queue()
        streams = [_Stream(self, index, group, bar) for index, group in enumerate(groups)]

        def work(stream: _Stream) -> None:
            try:
                for dest in stream.run():
                    done.put(dest)
                    if stream.stop.reason is not None:
                        return
            except BaseException as exc:  # relayed to the caller's thread
                done.put(exc)
            finally:
                done.put(None)

        workers = [
            threading.Thread(target=work, args=(stream,), name=f"weightstream-stream-{stream.index}", daemon=True)
            for stream in streams
        ]
        for worker in workers:
            worker.start()
        running = len(workers)
        try:
            while running:
                item = done.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for stream in streams:
                stream.stop.cancel(STOPPED)
            for worker in workers:
                worker.join(timeout=30)

    def count(
        self,
        *,
        retries: int = 0,
        resent_bytes: int = 0,
        delta_chunks: int = 0,
        delta_bytes: int = 0,
        delta_fallbacks: int = 0,
    ) -> None:
        """Add to the tally; called by every stream's thread."""
        with self._tally_lock:
            self.retries += retries
            self.resent_bytes += resent_bytes
            self.delta_chunks += delta_chunks
            self.delta_bytes += delta_bytes
            self.delta_fallbacks += delta_fallbacks

    def precondition_failed(self, exc: grpc.RpcError) -> WeightStreamError:
        """FAILED_PRECONDITION on a stream: say so plainly when the checkpoint changed since the manifest."""
        error = from_rpc_error(exc, self.config.target)
        try:
            now = self.config.current_manifest(self.manifest.model)
        except WeightStreamError:
            return error
        if now.revision == self.manifest.revision:
            return error
        return FailedPreconditionError(
            f"model {self.manifest.model!r}: the checkpoint changed on the server during the load (revision "
            f"{self.manifest.revision} when the load began, {now.revision} now); the load stopped rather than mix "
            f"two versions ({error.message})"
        )


class _Stream:
    """One stream of a load: the tensors it still owes, those partly landed, its placers and its outage.

    Used by the one thread that runs it; stop.cancel, from any thread, ends it and its retries.
    """

    def __init__(self, session: LoadSession, index: int, infos: dict[str, TensorInfo], bar: tqdm) -> None:
        self.session = session
        self.index = index
        self.infos = infos
        self.bar = bar
        self.stop = StreamCancel()
        self.model = session.manifest.model
        self.pending = {name: info for name, info in infos.items() if info.nbytes}
        # Partly landed tensors, whose missing ranges a resume asks for; a complete one is the
        # caller's (iter_tensors must not hold every tensor it yielded).
        self.touched: dict[str, Destination] = {}
        for name, ranges in session.landed.items():
            if name in self.pending:
                dest = session.destination(name)
                for start, end in ranges:
                    dest.landed.add(start, end)
                self.touched[name] = dest
        retry = session.config.retry
        self.outage = Outage(retry) if retry is not None else None
        self.placers = Placers(session.config.chunk_bytes)
        # Whether the stream is waiting for a server that was not there (warned once per wait).
        self._waiting = False
        # Tensors whose destinations turned out not to hold the delta base (a delta's result failed
        # its check): the rest of them is asked for whole.
        self.whole: set[str] = set()
        self._fell_back = False
        # The tensors the attempt in flight asked deltas of.
        self._asked_delta: set[str] = set()
        # Applies the deltas of host destinations while the next chunks are received (made on first use).
        self._applier: Applier[tuple[ChunkRef, Destination, bytes]] | None = None
        # Per tensor, the ranges of deltas handed to the applier whose results are not taken yet: no
        # other chunk may write there (its bytes would be XORed, or would overwrite the checked result).
        self._applying: dict[str, list[tuple[int, int]]] = {}

    def run(self) -> Iterator[Destination]:
        """Place every chunk of the stream's tensors, yield each destination once complete.

        On a retryable failure (retry.RETRYABLE_CODES, or no message for idle_timeout seconds) the
        stream is asked again, after a backoff, for only what has not landed: whole tensors not
        begun, the missing ranges of those begun. Before each retry the stream waits for its
        channel to connect (see _pause), so that tries are not spent while the server is still
        starting. A stream that went idle, or whose call did not end when cancelled, resumes on a
        fresh channel (channels.replace). Every request carries the manifest's revision, so a
        checkpoint that changed meanwhile ends the load (FailedPreconditionError) instead of
        mixing two versions.
        """
        if not self.pending:
            return
        channels = self.session.config.channels
        transport = channels.transport(self.index)
        stopped = threading.Event()
        self.stop.on_cancel(stopped.set)
        try:
            while True:
                cancel = StreamCancel()
                self.stop.on_cancel(functools.partial(cancel.cancel, STOPPED))
                self._fell_back = False
                try:
                    yield from self._attempt(transport, cancel)
                except (grpc.RpcError, StreamAbandoned, TransportError) as exc:
                    if not self.pending:
                        break  # every byte landed and was checked; only the stream's end was lost
                    delay, reached = self._retry_delay(exc, cancel, transport)
                    if reached:  # a try that found no server resumed nothing
                        self.session.count(retries=1)
                    if cancel.reason == IDLE or isinstance(exc, StreamAbandoned):
                        # The call went quiet on a connection keepalive may still find alive: the
                        # same channel would put the resume on that connection again.
                        channels.replace(self.index, transport)
                        transport = channels.transport(self.index)
                    if self._pause(delay, reached, stopped):
                        raise WeightStreamError(f"model {self.model!r}: the load was stopped") from exc
                    continue
                if self.pending and self._fell_back:
                    continue  # what deltas could not make is asked for again, whole (not a retry)
                break
        finally:
            try:
                if self._applier is not None:
                    self._applier.close()
            finally:
                self.placers.close()
        if self.pending:
            raise IntegrityError(
                f"model {self.model!r}: the stream ended with {len(self.pending)} tensors incomplete "
                f"({self._missing_bytes()} bytes missing), for example {sorted(self.pending)[0]!r}"
            )

    def _attempt(self, transport: Transport, cancel: StreamCancel) -> Iterator[Destination]:
        """One request, for what has not landed: place its chunks, yield each tensor that completes."""
        # Tensors the last attempt completed as it ended (its deltas applied meanwhile), not yet yielded.
        yield from self._place_batch(())
        if not self.pending:
            return
        config = self.session.config
        watchdog = config.watchdog
        watch = watchdog.watch(cancel) if watchdog is not None else None
        batches = transport.stream(self._request(), config.channels.metadata, cancel, self._landing)
        try:
            while True:
                # The transport may give the last batch's memory back now (a slot to the server).
                self.placers.settle()
                if watch is not None:
                    watch.arm()
                batch = next(batches, None)
                if watch is not None:
                    watch.disarm()
                if batch is None:
                    yield from self._place_batch((), wait=True)
                    return
                yield from self._place_batch(batch)
        finally:
            try:
                self.placers.settle()  # before the transport unmaps what the copies read from
                self._settle_deltas()
            finally:
                batches.close()
                if watch is not None and watchdog is not None:
                    watchdog.unwatch(watch)

    def _place_batch(self, batch: Sequence[ChunkRef], *, wait: bool = False) -> Iterator[Destination]:
        """Place every chunk of batch, take the deltas applied meanwhile (all of them when wait); yield
        each tensor that completes."""
        landed = resent = 0
        placed_all = itertools.chain(((self._place(c), c.length) for c in batch), self._deltas_applied(wait))
        for placed, length in placed_all:
            if placed is None:
                continue
            dest, new = placed
            landed += new
            resent += length - new
            self.touched[dest.name] = dest
        for name, dest in list(self.touched.items()):
            if dest.complete and name in self.pending:
                self.placers.for_tensor(dest.buffer).finish(dest)
                del self.pending[name]
                del self.touched[name]
                yield dest
        if landed:
            self.bar.update(landed)
        if resent:
            self.session.count(resent_bytes=resent)
        if landed and self.outage is not None:
            self.outage.progressed()

    def _place(self, chunk: ChunkRef) -> tuple[Destination, int] | None:
        """Check one chunk (known tensor, bounds, a range nothing else wrote or writes into), write it
        into its tensor, check its CRC32C there; (destination, new bytes).

        The CRC32C is that of the bytes as they landed (as placed, or as received in place); a chunk
        that fails it leaves its range missing. A chunk over bytes that landed already, or over a
        delta still being applied, is refused (IntegrityError): a request asks only for what has not
        landed, and a second write there would change checked bytes after their check.
        """
        info = self.infos.get(chunk.tensor)
        if info is None:
            raise IntegrityError(f"model {self.model!r}: received a chunk of unrequested tensor {chunk.tensor!r}")
        if chunk.tensor not in self.whole or not chunk.encoding:
            self._refuse_overlap(chunk)
        if chunk.encoding:
            return self._apply_delta(chunk, info)
        size = chunk.received
        end = chunk.offset + size
        if size != chunk.length or end > info.nbytes:
            raise IntegrityError(
                f"model {self.model!r}: tensor {chunk.tensor!r}: chunk at offset {chunk.offset} with "
                f"{size} bytes (stated {chunk.length}) does not fit its {info.nbytes} bytes"
            )
        dest = self.session.destination(chunk.tensor) if size else None
        if dest is None:
            crc = 0  # of no bytes
        elif chunk.in_place:
            crc = chunk.landed_crc32c if chunk.landed_crc32c is not None else wire.crc32c_at(chunk.address, size)
        else:
            dest.written = True
            placer = self.placers.for_tensor(dest.buffer)
            crc = placer.place(dest, chunk.offset, chunk.address, size, chunk.region)
        if crc != chunk.crc32c:
            error = IntegrityError(
                f"model {self.model!r}: tensor {chunk.tensor!r}: CRC32C mismatch in the chunk at offset "
                f"{chunk.offset} ({size} bytes); the data was corrupted in transit"
            )
            if chunk.in_place:
                # Its bytes lie in the tensor, but its range stays missing: the resume asks for it again.
                raise TransportError(error)
            raise error
        if dest is None:
            return None
        return dest, dest.landed.add(chunk.offset, end)

    def _refuse_overlap(self, chunk: ChunkRef) -> None:
        """IntegrityError when chunk's range holds checked bytes or a delta being applied (see _place)."""
        end = chunk.offset + chunk.length
        if not chunk.length or end > self.infos[chunk.tensor].nbytes:
            return  # nothing to write, or out of bounds: the checks that follow say so
        dest = self.session.destination(chunk.tensor)
        landed = dest.landed.overlaps(chunk.offset, end)
        if not landed and not self._is_applying(chunk.tensor, chunk.offset, end):
            return
        what = "a delta of bytes" if chunk.encoding else "bytes"
        where = "bytes that landed and checked" if landed else "a delta being applied"
        raise IntegrityError(
            f"model {self.model!r}: tensor {chunk.tensor!r}: the server sent {what} [{chunk.offset}, {end}) over "
            f"{where}; refused (a request asks for each byte once)"
        )

    def _is_applying(self, tensor: str, start: int, end: int) -> bool:
        return any(s < end and start < e for s, e in self._applying.get(tensor, ()))

    def _apply_delta(self, chunk: ChunkRef, info: TensorInfo) -> tuple[Destination, int] | None:
        """XOR a delta chunk into its destination and check the result; (destination, new bytes), or
        None when the result failed its check (then the tensor's missing bytes are asked for whole)."""
        end = chunk.offset + chunk.length
        if (
            chunk.encoding not in DELTA_ENCODINGS
            or chunk.tensor not in self._asked_delta
            or chunk.received != chunk.encoded_length
            or end > info.nbytes
        ):
            raise IntegrityError(
                f"model {self.model!r}: tensor {chunk.tensor!r}: a chunk at offset {chunk.offset} came encoded "
                f"({chunk.encoding}, {chunk.received} of {chunk.encoded_length} payload bytes for {chunk.length}) "
                "where no delta was asked for, or does not fit the tensor"
            )
        if chunk.tensor in self.whole:
            return None  # its destination did not hold the base: the rest of it comes whole next
        dest = self.session.destination(chunk.tensor)
        crc: int | None = None
        # _place refused a range that holds checked bytes or another delta (XOR twice undoes it).
        try:
            dest.written = True
            if dest.buffer.device.type == "cpu":
                if self._applier is None:
                    threads = APPLIER_THREADS // self.session.config.streams  # the load's, shared out
                    self._applier = Applier(f"model {self.model!r}", threads)
                # The applier's copy of the payload, also what a delta sink is handed once it checked.
                payload = bytes(wire.memory_at(chunk.address, chunk.encoded_length))
                self._applier.submit(
                    (chunk, dest, payload), dest.buffer[chunk.offset : end], chunk.offset, payload, chunk.encoding
                )
                self._applying.setdefault(chunk.tensor, []).append((chunk.offset, end))
                return None  # its result is taken by _deltas_applied
            crc = apply_delta(dest, chunk.offset, chunk.length, chunk.address, chunk.encoded_length, chunk.encoding)
        except DeltaUnusable as exc:
            logger.warning("model %r: tensor %r: a delta did not decode (%s)", self.model, chunk.tensor, exc)
        return self._delta_checked(chunk, dest, crc, None)

    def _delta_checked(
        self, chunk: ChunkRef, dest: Destination, crc: int | None, payload: bytes | None
    ) -> tuple[Destination, int] | None:
        """A delta's result, CRC32C crc (None: not applied), checked against its chunk: (destination, new
        bytes), or None when it failed (the tensor's missing bytes are then asked for whole). A checked
        one is handed to the session's delta sink (payload: its bytes, None: still at chunk.address)."""
        if crc != chunk.crc32c:
            # The destination did not hold the base revision there (or the delta was damaged).
            self.whole.add(chunk.tensor)
            self._fell_back = True
            self.session.count(delta_fallbacks=1)
            return None
        self.session.count(delta_chunks=1, delta_bytes=chunk.encoded_length)
        sink = self.session.delta_sink
        if sink is not None:
            if payload is None:
                payload = bytes(wire.memory_at(chunk.address, chunk.encoded_length))
            sink(chunk.tensor, chunk.offset, chunk.length, chunk.encoding, payload)
        return dest, dest.landed.add(chunk.offset, chunk.offset + chunk.length)

    def _deltas_applied(self, wait: bool) -> Iterator[tuple[tuple[Destination, int] | None, int]]:
        """(_delta_checked's answer, chunk length) for each delta the applier finished (all, when wait)."""
        if self._applier is None:
            return
        for (chunk, dest, payload), crc in self._applier.results(wait=wait):
            self._applying[chunk.tensor].remove((chunk.offset, chunk.offset + chunk.length))
            yield self._delta_checked(chunk, dest, crc, payload), chunk.length

    def _settle_deltas(self) -> None:
        """As an attempt ends: wait for the deltas still being applied and record what they landed
        (the next attempt yields the tensors that completed)."""
        for placed, _length in self._deltas_applied(wait=True):
            if placed is not None:
                self.touched[placed[0].name] = placed[0]

    def _landing(self, tensor: str, offset: int, length: int) -> int | None:
        """Where a transport may receive these bytes of tensor directly: host memory of its destination
        that holds no checked byte yet; None otherwise (the chunk then comes through the transport's
        own buffer and is placed as usual). The destination counts as written from here on."""
        info = self.infos.get(tensor)
        if info is None or not length or offset + length > info.nbytes:
            return None
        dest = self.session.destination(tensor)
        if (
            dest.buffer.device.type != "cpu"
            or dest.landed.overlaps(offset, offset + length)
            or self._is_applying(tensor, offset, offset + length)
        ):
            return None
        dest.written = True
        return int(dest.buffer.data_ptr()) + offset

    def _request(self) -> pb.StreamTensorsRequest:
        """The request for what has not landed: whole pending tensors, or their missing ranges once begun."""
        manifest = self.session.manifest
        sliced = any(info.slice is not None for info in self.infos.values())
        begun = bool(self.touched) or len(self.pending) < sum(1 for info in self.infos.values() if info.nbytes)
        deltas = self.session.delta_tensors
        everything = not begun and not sliced and not deltas and len(self.infos) == len(manifest.tensors)
        tensors = []
        if not everything:
            for name, info in self.pending.items():
                dest = self.touched.get(name)
                ranges = [pb.ByteRange(start=s, end=e) for s, e in dest.landed.missing()] if dest is not None else []
                request = pb.TensorRequest(name=name, ranges=ranges, delta=name in deltas and name not in self.whole)
                if info.slice is not None:
                    s = info.slice
                    request.slice.CopyFrom(pb.TensorSlice(dim=s.dim, start=s.start, stop=s.stop))
                tensors.append(request)
        self._asked_delta = {t.name for t in tensors if t.delta}
        return pb.StreamTensorsRequest(
            model=manifest.model,
            tensors=tensors,
            max_chunk_bytes=self.session.config.chunk_bytes,
            revision=manifest.revision,
            delta_base=self.session.delta_base if self._asked_delta else "",
        )

    def _retry_delay(
        self, exc: grpc.RpcError | StreamAbandoned | TransportError, cancel: StreamCancel, transport: Transport
    ) -> tuple[float, bool]:
        """(seconds to wait, whether the try reached a server) after exc ended the try cancel stops.

        Raises the load's error instead when the load was stopped, a precondition failed, or
        decide_retry gives up. transport is the try's. A try is cancelled only by the watchdog and
        by the load's stop, so one abandoned while the load runs was idle.
        """
        code, _ = status_of(exc)
        if self.stop.reason is not None:
            raise WeightStreamError(f"model {self.model!r}: the load was stopped") from exc
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            assert isinstance(exc, grpc.RpcError)
            raise self.session.precondition_failed(exc) from exc
        target = self.session.config.target
        decision = decide_retry(
            exc,
            idle=cancel.reason == IDLE or isinstance(exc, StreamAbandoned),
            replaced=code == grpc.StatusCode.CANCELLED and self.session.config.channels.replaced(transport),
            outage=self.outage,
            model=self.model,
            target=target,
            missing_bytes=self._missing_bytes,
        )
        # decide_retry returns only where the load has a policy (an outage) to retry under.
        assert self.outage is not None and self.session.config.retry is not None
        if decision.reached:
            self._waiting = False
            logger.warning(
                "model %r: stream from %s failed (%s), try %d of %d in %.2f s for the %d bytes missing",
                self.model,
                target,
                decision.what,
                self.outage.failures + 1,
                self.session.config.retry.attempts,
                decision.delay,
                self._missing_bytes(),
            )
        else:
            # One warning per wait: the probes that follow come every few seconds.
            log = logger.info if self._waiting else logger.warning
            self._waiting = True
            log(
                "model %r: no server at %s (%s) for %.1f s; waiting for one, at most %.0f s more",
                self.model,
                target,
                decision.details,
                self.outage.elapsed,
                self.outage.remaining,
            )
        return decision.delay, decision.reached

    def _pause(self, delay: float, reached: bool, stopped: threading.Event) -> bool:
        """Wait before the next try; True if the load was stopped meanwhile.

        After a try that reached a server: its backoff. After one that found no server: until the
        channel connects, at most the backoff (or READY_WAIT_S), and no longer once it does,
        since there was no server to spare. The next try then goes, connected or not; if not, its
        error says why.
        """
        assert self.outage is not None
        if reached:
            return stopped.wait(delay)
        wait = min(max(delay, READY_WAIT_S), self.outage.remaining)
        self.session.config.channels.wait_ready(self.index, wait, self.stop)
        return stopped.is_set()

    def _missing_bytes(self) -> int:
        return sum(
            self.touched[name].nbytes - self.touched[name].landed.covered if name in self.touched else info.nbytes
            for name, info in self.pending.items()
        )


def split(infos: dict[str, TensorInfo], streams: int) -> list[dict[str, TensorInfo]]:
    """infos cut into at most `streams` groups of about equal bytes (largest tensors first)."""
    sized = sorted((info for info in infos.values() if info.nbytes), key=lambda i: -i.nbytes)
    count = max(1, min(streams, len(sized)))
    groups: list[dict[str, TensorInfo]] = [{} for _ in range(count)]
    loads = [0] * count
    for info in sized:
        smallest = loads.index(min(loads))
        groups[smallest][info.name] = info
        loads[smallest] += info.nbytes
    for info in infos.values():
        if not info.nbytes:
            groups[0][info.name] = info
    return groups
