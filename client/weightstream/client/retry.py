"""When a broken stream is retried: the decision, the policy, its backoff, and the idle-stream watchdog.

A stream is retried on UNAVAILABLE (server gone, restarted or draining, connection reset),
RESOURCE_EXHAUSTED (every stream slot taken), ABORTED, and when no message arrived for
idle_timeout seconds (the watchdog cancels the call). Everything else ends the load, and so does
UNAVAILABLE that says the connection can never succeed as configured (permanent_connect_error).
decide_retry makes that decision for one failed try and raises the load's error when it gives up;
the load session only waits and resumes.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from weightstream.client.errors import UnavailableError, WeightStreamError, from_rpc_error
from weightstream.client.transports.base import StreamCancel, TransportError
from weightstream.client.transports.call_reader import CANCEL_GRACE_S, StreamAbandoned

Failed = grpc.RpcError | StreamAbandoned | TransportError

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED})
# The reason a StreamCancel carries when the watchdog stopped an idle stream.
IDLE = "idle"
# After a try that found no server, the next waits for the channel to connect, for its backoff
# but at least this many seconds, before it goes anyway (and its error says why it could not).
READY_WAIT_S = 1.0
# Failures to connect that no retry can mend: a TLS handshake refused, or a certificate not trusted.
_PERMANENT_CONNECT_ERRORS = ("handshake", "ssl", "certificate")
# What gRPC says when no server was there to reach: nothing listening, no route, no answer at all.
_NO_SERVER_ERRORS = (
    "connection refused",
    "no route to host",
    "network is unreachable",
    "dns resolution failed",
    "timed out",
    "timeout",
)


def permanent_connect_error(message: str) -> bool:
    """True for an UNAVAILABLE message that says the connection can never succeed as configured (TLS)."""
    lowered = message.lower()
    return any(word in lowered for word in _PERMANENT_CONNECT_ERRORS)


def reached_no_server(message: str) -> bool:
    """True for an UNAVAILABLE message that says the try found no server at all (one not started yet, or gone).

    Such a failure says nothing about a server, so it is waiting rather than a try. A peer that
    accepted the connection and closed it ("Socket closed", a TLS server asked in plaintext) was
    reached.
    """
    reason = message.lower().rsplit("last error:", 1)[-1]
    return any(words in reason for words in _NO_SERVER_ERRORS)


def status_of(exc: Failed) -> tuple[grpc.StatusCode, str]:
    """The status code and details a failed try ended with (a broken data connection counts as UNAVAILABLE)."""
    if isinstance(exc, TransportError):
        return grpc.StatusCode.UNAVAILABLE, exc.error.message
    if isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.UNKNOWN, ""


@dataclass(frozen=True)
class RetryDecision:
    """Try again after delay seconds. reached: the try found a server (else it was a wait for one)."""

    delay: float
    reached: bool
    what: str  # the failure in words, for the log line
    details: str  # what gRPC said


def decide_retry(
    exc: Failed,
    *,
    idle: bool,
    replaced: bool,
    outage: Outage | None,
    model: str,
    target: str,
    missing_bytes: Callable[[], int],
) -> RetryDecision:
    """Whether the try that exc ended is tried again, and when; raises the load's error when it is not.

    idle: the watchdog cancelled the try as idle (or its call was abandoned after the cancel).
    replaced: the call ended CANCELLED because another stream replaced its channel, which is
    retried like a broken one. outage is None when the load has no retry policy.
    """
    code, details = status_of(exc)
    abandoned = isinstance(exc, StreamAbandoned)
    if abandoned and outage is None:  # not expected: without a policy nothing watches for idle streams
        raise UnavailableError(f"from {target}: the stream stopped", code=grpc.StatusCode.UNAVAILABLE) from exc
    retryable = idle or replaced or (code in RETRYABLE_CODES and not permanent_connect_error(details))
    if outage is None or not retryable:
        if isinstance(exc, TransportError):
            raise exc.error from exc
        raise exc
    what = f"no message for {outage.idle_timeout:g} s" if idle else code.name
    if isinstance(exc, TransportError):
        what = exc.error.message
    if abandoned:
        what += f", and the call had not ended {CANCEL_GRACE_S:g} s after its cancel"
    found_no_server = code == grpc.StatusCode.UNAVAILABLE and reached_no_server(details)
    reached = isinstance(exc, TransportError) or not found_no_server
    delay = outage.next_delay(reached=reached)
    if delay is None:
        error: WeightStreamError
        if isinstance(exc, TransportError):
            error = exc.error
        elif isinstance(exc, grpc.RpcError) and not idle:
            error = from_rpc_error(exc, target)
        else:
            error = UnavailableError(f"from {target}: {what}", code=grpc.StatusCode.UNAVAILABLE)
        raise type(error)(
            f"model {model!r}: {error.message}; gave up after {outage.failures} tries in "
            f"{outage.elapsed:.1f} s with {missing_bytes()} bytes missing",
            code=error.code,
        ) from exc
    return RetryDecision(delay, reached, what, details)


@dataclass(frozen=True)
class RetryPolicy:
    """How a load retries: exponential backoff with full jitter, bounded per outage.

    An outage is a run of failures with no new byte landing in between: it may last at most
    `attempts` tries and `total_deadline` seconds from its first failure. Any new byte ends the
    outage, so a long load survives many separate faults. `attempts` counts only tries that
    reached a server: a failure that found none there (connection refused while a server
    restarts) counts against total_deadline alone, and the next try waits for the channel to
    connect rather than fail at once against gRPC's reconnect backoff, so a server that takes long
    to come back costs time, not tries.
    idle_timeout: a stream that receives no message for that long is cancelled and retried on a
    fresh connection (the server is stuck, or a peer vanished without closing the connection).
    """

    attempts: int = 10
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    total_deadline: float = 300.0
    idle_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {self.attempts}")
        if not 0 < self.initial_backoff <= self.max_backoff:
            raise ValueError(f"need 0 < initial_backoff <= max_backoff, not {self.initial_backoff}, {self.max_backoff}")
        if self.total_deadline <= 0 or self.idle_timeout <= 0:
            raise ValueError("total_deadline and idle_timeout must be positive")

    def backoff(self, retry: int, rng: random.Random) -> float:
        """Seconds to wait before retry number retry (0 first): full jitter over the exponential step."""
        return rng.uniform(0.0, min(self.max_backoff, self.initial_backoff * 2.0**retry))


class Outage:
    """The failures of one stream since its last progress; says whether, and after how long, to retry.

    failures counts the tries that reached a server; a failure that says no server was there
    (unreached) moves the backoff on and counts against total_deadline, but is not a try.
    """

    def __init__(self, policy: RetryPolicy, rng: random.Random | None = None) -> None:
        self._policy = policy
        self._rng = rng or random.Random()
        self.failures = 0
        # Every failure of the outage, tries or not: the backoff's step.
        self._steps = 0
        self._since = 0.0

    def progressed(self) -> None:
        self.failures = 0
        self._steps = 0

    def next_delay(self, *, reached: bool = True) -> float | None:
        """Count one more failure (a try when reached); the seconds to wait before the next try, or None to give up."""
        now = time.monotonic()
        if self._steps == 0:
            self._since = now
        self._steps += 1
        if reached:
            self.failures += 1
        if self.failures >= self._policy.attempts:
            return None
        remaining = self._policy.total_deadline - (now - self._since)
        if remaining <= 0:
            return None
        return min(self._policy.backoff(self._steps - 1, self._rng), remaining)

    @property
    def idle_timeout(self) -> float:
        return self._policy.idle_timeout

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._since if self._steps else 0.0

    @property
    def remaining(self) -> float:
        """Seconds left of the outage's total_deadline (all of it before the first failure)."""
        return max(0.0, self._policy.total_deadline - self.elapsed)


class Watch:
    """One watched stream: armed while its reader waits for a message."""

    __slots__ = ("cancel", "waiting_since")

    def __init__(self, cancel: StreamCancel) -> None:
        self.cancel = cancel
        # monotonic() when the reader began waiting; None while it handles a message (or its caller
        # holds a yielded tensor), so time spent outside the wait never counts as idle.
        self.waiting_since: float | None = None

    def arm(self) -> None:
        self.waiting_since = time.monotonic()

    def disarm(self) -> None:
        self.waiting_since = None


class IdleWatchdog:
    """One daemon thread per client that cancels streams idle for longer than timeout seconds.

    Readers only store a float per message (Watch.arm/disarm); the thread wakes a few times per
    timeout while streams are watched, and sleeps without waking while none are.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._watches: set[Watch] = set()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, cancel: StreamCancel) -> Watch:
        watch = Watch(cancel)
        with self._wake:
            self._watches.add(watch)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="weightstream-idle-watchdog", daemon=True)
                self._thread.start()
            self._wake.notify()
        return watch

    def unwatch(self, watch: Watch) -> None:
        with self._wake:
            self._watches.discard(watch)

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        period = max(0.05, self.timeout / 4)
        while True:
            with self._wake:
                if self._closed:
                    return
                self._wake.wait(period if self._watches else None)
                if self._closed:
                    return
                now = time.monotonic()
                idle = [
                    w for w in self._watches if w.waiting_since is not None and now - w.waiting_since > self.timeout
                ]
            for watch in idle:
                watch.cancel.cancel(IDLE)
