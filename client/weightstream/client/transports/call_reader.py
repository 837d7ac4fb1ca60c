"""A call's messages read on a helper thread, so that a stream's thread can always give up on a stuck call.

A gRPC stream is read by blocking in the call's iterator, and only the call can end that wait:
cancel() normally does within milliseconds, but a call stuck inside gRPC's core was seen to ignore
it and hold the reading thread forever. CallReader iterates the call on a thread of its own and
hands each message over through a small queue, so that the stream's thread waits on the queue
instead. Once the stream's StreamCancel fires, the call has `grace` seconds to end; if it has not,
the stream's thread gets StreamAbandoned and moves on (the load then replaces the channel and
resumes, session.py), and the helper thread, still stuck, drops whatever it receives later.

Memory: messages are read ahead of the consumer, at most READ_AHEAD of them waiting in the queue
plus one in the helper's hands (for the gRPC transport, that many received messages of up to a
chunk's size each). A transport's own contract is unchanged: batches are still made and handed
out on the stream's thread, one at a time.

Threading: one thread (the stream's) iterates a CallReader; only the helper thread iterates the
call. StreamCancel.cancel may come from any thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Generic, TypeVar

from weightstream.client.transports.base import StreamCancel

# Seconds a cancelled call gets to end before its reader gives it up. A call ends within
# milliseconds of its cancel; this is for one stuck inside gRPC, which never does.
CANCEL_GRACE_S = 5.0
# Messages received ahead of the consumer and waiting in the queue.
READ_AHEAD = 1
# How often a helper thread with a message to hand over looks whether the reader was closed.
_OFFER_POLL_S = 0.5

Message = TypeVar("Message")


class StreamAbandoned(Exception):
    """A cancelled call did not end within its grace; its reader stopped waiting for it."""


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# Queue items that are not messages: the call ended; the stream was cancelled (a wake-up).
_END = _Marker("END")
_CANCELLED = _Marker("CANCELLED")


class CallReader(Generic[Message]):
    """The messages of call (any iterator of them, usually a gRPC call), read by a helper thread.

    Iterating yields them in order and raises what iterating the call raised (grpc.RpcError), or
    StreamAbandoned once cancel has fired and the call still has not ended grace seconds later.
    close() lets the helper thread go; the transport cancels the call itself. name names the
    helper thread.
    """

    def __init__(self, call: Iterator[Message], cancel: StreamCancel, *, name: str, grace: float = CANCEL_GRACE_S):
        self._call = call
        self._grace = grace
        self._queue: queue.Queue[Message | BaseException | _Marker] = queue.Queue(maxsize=READ_AHEAD)
        # monotonic() when cancel fired; read by the stream's thread, written by the canceller.
        self._cancelled_at: float | None = None
        self._closed = False
        self._ended = False
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()
        cancel.on_cancel(self._wake)

    def __iter__(self) -> CallReader[Message]:
        return self

    def __next__(self) -> Message:
        if self._ended:
            raise StopIteration
        while True:
            cancelled_at = self._cancelled_at
            timeout = None if cancelled_at is None else max(0.0, cancelled_at + self._grace - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                self._ended = True
                self.close()
                raise StreamAbandoned(
                    f"the call was cancelled and had not ended {self._grace:g} s later; it was left behind"
                ) from None
            if item is _CANCELLED:
                continue
            if item is _END:
                self._ended = True
                raise StopIteration
            if isinstance(item, BaseException):
                self._ended = True
                raise item
            assert not isinstance(item, _Marker)
            return item

    def outcome(self, timeout: float) -> BaseException | None:
        """Wait up to timeout s for the call to end, dropping its messages; what it raised, or None if it ended OK.

        TimeoutError when it has not ended by then.
        """
        deadline = time.monotonic() + timeout
        while not self._ended:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the call had not ended {timeout:g} s later") from None
            if item is _END:
                self._ended = True
                return None
            if isinstance(item, BaseException):
                self._ended = True
                return item
        return None

    def close(self) -> None:
        """Stop handing messages over; a helper thread still waiting in the call leaves once the call ends."""
        self._closed = True
        while True:  # frees a helper blocked on a full queue, and the messages it held
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def _wake(self) -> None:
        self._cancelled_at = time.monotonic()
        try:
            self._queue.put_nowait(_CANCELLED)
        except queue.Full:
            pass  # an item is waiting: the consumer is not blocked, and sees _cancelled_at next time

    def _read(self) -> None:
        try:
            for message in self._call:
                if not self._offer(message):
                    return
        except BaseException as exc:  # relayed to the stream's thread
            self._offer(exc)
            return
        self._offer(_END)

    def _offer(self, item: Message | BaseException | _Marker) -> bool:
        while not self._closed:
            try:
                self._queue.put(item, timeout=_OFFER_POLL_S)
                return True
            except queue.Full:
                continue
        return False
