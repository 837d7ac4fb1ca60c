"""Resume details: the manifest waits for a late server, a dead peer is noticed in seconds, retry=None fails fast."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.support.checkpoints import write_model
from tests.support.faults import CuttingProxy
from tests.support.ports import free_ports
from tests.support.serve_processes import Supervisor
from weightstream.client import RetryPolicy, UnavailableError, WeightStreamClient
from weightstream.client.retry import IDLE, IdleWatchdog, Outage
from weightstream.client.transports.base import StreamCancel
from weightstream.demo import ParameterTree
from weightstream_server import WeightStreamServer

QUICK = RetryPolicy(attempts=100, initial_backoff=0.05, max_backoff=0.5, total_deadline=60.0, idle_timeout=30.0)


def test_backoff_is_bounded_and_an_outage_ends_after_its_attempts() -> None:
    policy = RetryPolicy(attempts=4, initial_backoff=0.1, max_backoff=0.3)
    outage = Outage(policy)
    delays = [outage.next_delay() for _ in range(4)]
    assert all(d is not None and 0 <= d <= 0.3 for d in delays[:3]), delays
    assert delays[3] is None
    outage.progressed()
    assert outage.next_delay() is not None  # progress starts a new outage


def test_idle_watchdog_cancels_only_a_stream_waiting_too_long() -> None:
    watchdog = IdleWatchdog(0.2)
    try:
        waiting, busy = StreamCancel(), StreamCancel()
        watchdog.watch(waiting).arm()
        watchdog.watch(busy)  # never armed: its reader is handling a message
        deadline = time.monotonic() + 5
        while waiting.reason is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert waiting.reason == IDLE
        assert busy.reason is None
    finally:
        watchdog.close()


@pytest.mark.slow
def test_manifest_waits_for_a_server_that_starts_late(model_root: Path, tmp_path: Path) -> None:
    write_model(model_root, "late-model", tensors=2, numel=1024)
    (port,) = free_ports(1)
    with WeightStreamClient(f"127.0.0.1:{port}", progress=False, retry=None, timeout=5) as client:
        with pytest.raises(UnavailableError):
            client.manifest("late-model")
    supervisor = Supervisor(model_root, tmp_path, port=port)
    starter = threading.Thread(target=supervisor.start)
    try:
        with WeightStreamClient(supervisor.target, progress=False, retry=QUICK, timeout=5) as client:
            starter.start()  # the client asks before the server listens
            assert len(client.manifest("late-model").tensors) == 2
    finally:
        starter.join(timeout=60)
        supervisor.stop()


def test_without_retry_a_cut_ends_the_load_and_says_it_was_partly_written(
    model_root: Path, server: WeightStreamServer
) -> None:
    state = write_model(model_root, "cut-once", tensors=8, numel=1 << 20)
    module = ParameterTree({n: (tuple(t.shape), t.dtype) for n, t in state.items()})
    with CuttingProxy(server.port, [(12 << 20, "reset")]) as proxy:
        with WeightStreamClient(proxy.target, progress=False, retry=None) as client:
            with pytest.raises(UnavailableError) as info:
                client.load_into(module, "cut-once")
    assert info.value.partially_written is True
    assert "partly written" in str(info.value)


@pytest.mark.slow
def test_a_peer_that_goes_silent_is_noticed_in_seconds(model_root: Path, server: WeightStreamServer) -> None:
    """The proxy stops relaying (both ways) without closing: keepalive or the idle deadline must end the wait."""
    state = write_model(model_root, "frozen", tensors=8, numel=1 << 20)
    module = ParameterTree({n: (tuple(t.shape), t.dtype) for n, t in state.items()})
    policy = RetryPolicy(attempts=100, initial_backoff=0.05, max_backoff=0.5, total_deadline=60.0, idle_timeout=2.0)
    with CuttingProxy(server.port, [(6 << 20, "freeze")]) as proxy:
        with WeightStreamClient(proxy.target, progress=False, retry=policy) as client:
            started = time.monotonic()
            report = client.load_into(module, "frozen")
            seconds = time.monotonic() - started
    assert report.retries >= 1
    assert all(module.get_parameter(n).equal(t) for n, t in state.items())
    # Client keepalive: a ping after 10 s without reads, 5 s to answer; then a new connection.
    assert seconds < 30, f"the silent peer took {seconds:.1f} s to notice"
