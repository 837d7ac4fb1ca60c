"""Fan-out keep-alives (StreamRevisionBlocks' keepalive_ms, answered with waiting) between real servers on 127.0.0.1.

An origin (--fanout) publishes a revision; a sidecar (--peers) serves it to pull_blocks, called
directly with the sidecar (or a proxy in front of it) as the parent (the origin never plans a loopback
peer itself). The sidecar's own pull of the revision is stood in for by the test, which begins a Pull
in the sidecar's holdings and writes the published bytes into it when it chooses (late, or never):
how late a real sidecar's own pull starts cannot be chosen. Everything else is the real serving and
pulling code over gRPC. A cut link is a proxy that stops forwarding; a server that predates
keep-alives, a proxy that drops keepalive_ms from the request (such a server never reads it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf.message import Message

from tests.support.hostile_peer import serve_blocks
from tests.support.ports import LOOPBACK
from tests.support.proxies import RewritingProxy
from tests.support.servers import loopback_settings, serving
from weightstream.client import WeightStreamClient
from weightstream.client.manifest import Manifest
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server import WeightStreamServer
from weightstream_server.revisions.peer_blocks import KEEPALIVE_MAX_S, KEEPALIVE_MIN_S, Holdings, blocks_of
from weightstream_server.revisions.peer_pull import (
    FIRST_BLOCK_STALLS,
    KEEPALIVE_FIRST_BLOCK_STALLS,
    PullReport,
    keepalive_ms,
    pull_blocks,
)
from weightstream_server.revisions.store import RevisionStore

MODEL = "fanout-keepalive"
NBYTES = 3 * 1024 * 1024
# Longest any proxy or hostile peer holds a call: every wait in these tests ends.
HOLD_S = 30.0


def _state(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(NBYTES // 4, generator=torch.Generator().manual_seed(seed))}


@contextlib.contextmanager
def _origin_and_sidecar(
    tmp_path: Path, state: dict[str, torch.Tensor]
) -> Iterator[tuple[WeightStreamClient, Manifest, WeightStreamServer]]:
    """The origin's client, the manifest of state published there, and a sidecar with --peers below it."""
    with serving(loopback_settings(model_root=tmp_path, allow_publish=True, fanout=True)) as origin:
        target = f"{LOOPBACK}:{origin.port}"
        with WeightStreamClient(target, progress=False) as upstream:
            manifest = upstream.manifest(MODEL, revision=upstream.publish(MODEL, state))
            with serving(loopback_settings(upstream=target, peers=True)) as sidecar:
                yield upstream, manifest, sidecar


@contextlib.contextmanager
def _setting_up(
    sidecar: WeightStreamServer, manifest: Manifest, state: dict[str, torch.Tensor], arrives_s: float | None
) -> Iterator[None]:
    """The sidecar's own pull of manifest's revision, begun now, state's blocks all arriving arrives_s
    seconds from now (None: never); ended on the way out."""
    holdings = sidecar.holdings
    assert holdings is not None
    views = {name: torch.empty_like(tensor) for name, tensor in state.items()}
    pull = holdings.begin(MODEL, manifest.revision, views)
    ended = threading.Event()

    def arrive() -> None:
        if arrives_s is None or ended.wait(arrives_s):
            return
        for name, tensor in state.items():
            views[name].copy_(tensor)
            pull.advance(name, blocks_of(tensor.numel() * tensor.element_size()))

    thread = threading.Thread(target=arrive, daemon=True)
    thread.start()
    try:
        yield
    finally:
        ended.set()
        thread.join(HOLD_S)
        holdings.end(pull)


def _pull(
    upstream: WeightStreamClient, manifest: Manifest, state: dict[str, torch.Tensor], parent: str, stall_s: float
) -> tuple[PullReport, Holdings, float]:
    """pull_blocks of state's tensors from parent (the rest from upstream), checked bit-exact; and its seconds."""
    holdings = Holdings(RevisionStore())
    views = {name: torch.empty_like(tensor) for name, tensor in state.items()}

    def connect(address: str) -> WeightStreamClient:
        return WeightStreamClient(address, progress=False, retry=None)

    started = time.monotonic()
    report = pull_blocks(holdings, upstream, connect, manifest, views, list(state), parent, stall_s)
    seconds = time.monotonic() - started
    assert report.pull is not None
    holdings.end(report.pull)
    assert all(torch.equal(views[name], state[name]) for name in state)
    return report, holdings, seconds


class _CutLink(RewritingProxy):
    """Forwards StreamRevisionBlocks until `after` keep-alives passed, then nothing (a link cut)."""

    def __init__(self, upstream_port: int, after: int) -> None:
        super().__init__(upstream_port)
        self._after = after
        self.passed = 0
        self.released = threading.Event()

    def answer(self, method: str, response: Message) -> Iterable[Message]:
        if method == "StreamRevisionBlocks":
            if self.passed >= self._after:
                self.released.wait(HOLD_S)
                return ()
            assert isinstance(response, pb.StreamRevisionBlocksResponse)
            self.passed += response.waiting
        return (response,)


class _OlderServer(RewritingProxy):
    """StreamRevisionBlocks requests reach the server without keepalive_ms, as a server that predates it reads them."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(upstream_port)
        self.asked: list[int] = []
        self.waiting = 0

    def ask(self, method: str, request: Message) -> Message:
        if isinstance(request, pb.StreamRevisionBlocksRequest):
            self.asked.append(request.keepalive_ms)
            request.ClearField("keepalive_ms")
        return request

    def answer(self, method: str, response: Message) -> Iterable[Message]:
        if isinstance(response, pb.StreamRevisionBlocksResponse):
            self.waiting += response.waiting
        return (response,)


@pytest.mark.slow  # waits out more than FIRST_BLOCK_STALLS stall times of 0.2 s
def test_a_peer_still_setting_up_past_the_first_block_allowance_is_kept_while_it_sends_keepalives(
    tmp_path: Path,
) -> None:
    """Its first block comes after more than FIRST_BLOCK_STALLS stall times; its keep-alives keep it,
    and the whole revision comes from it."""
    stall = 0.2
    late = (FIRST_BLOCK_STALLS + 5) * stall
    state = _state(11)
    with (
        _origin_and_sidecar(tmp_path, state) as (upstream, manifest, sidecar),
        _setting_up(sidecar, manifest, state, late),
    ):
        report, holdings, seconds = _pull(upstream, manifest, state, f"{LOOPBACK}:{sidecar.port}", stall)
    assert seconds > (FIRST_BLOCK_STALLS + 1) * stall, seconds  # its first block came after the old allowance
    assert holdings.counts.fallbacks == 0
    assert report.peer_bytes == NBYTES and report.upstream_bytes == 0, report


def test_a_peer_whose_link_is_cut_after_keepalives_is_left_after_about_one_stall_time(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Keep-alives came, then nothing (the link cut before the first block): left about one stall time
    after the last keep-alive, not FIRST_BLOCK_STALLS stall times after the request; the revision
    comes whole from the origin."""
    stall = 0.5
    state = _state(12)
    caplog.set_level(logging.WARNING, logger="weightstream_server.revisions.peer_pull")
    with (
        _origin_and_sidecar(tmp_path, state) as (upstream, manifest, sidecar),
        _setting_up(sidecar, manifest, state, None),
        _CutLink(sidecar.port, after=2) as link,
    ):
        try:
            report, holdings, seconds = _pull(upstream, manifest, state, link.target, stall)
        finally:
            link.released.set()
    assert link.passed == 2
    assert stall <= seconds < 4 * stall < FIRST_BLOCK_STALLS * stall, seconds
    assert holdings.counts.fallbacks == 1
    assert report.peer_bytes == 0 and report.upstream_bytes == NBYTES, report
    assert any("left" in r.getMessage() and "after its keep-alives" in r.getMessage() for r in caplog.records), [
        r.getMessage() for r in caplog.records
    ]


@pytest.mark.slow  # waits five stall times of 0.2 s for the first block
def test_a_peer_that_sends_no_keepalives_keeps_the_first_block_allowance(tmp_path: Path) -> None:
    """A server that predates keep-alives (keepalive_ms never reaches it) sends none: its first block,
    five stall times late, is still taken (FIRST_BLOCK_STALLS), not left after one stall time."""
    stall = 0.2
    state = _state(13)
    with (
        _origin_and_sidecar(tmp_path, state) as (upstream, manifest, sidecar),
        _setting_up(sidecar, manifest, state, 5 * stall),
        _OlderServer(sidecar.port) as older,
    ):
        report, holdings, seconds = _pull(upstream, manifest, state, older.target, stall)
    assert older.asked == [keepalive_ms(stall)] and older.waiting == 0
    assert seconds >= 5 * stall, seconds
    assert holdings.counts.fallbacks == 0
    assert report.peer_bytes == NBYTES and report.upstream_bytes == 0, report


def test_the_keepalive_period_asked_for_is_held_to_its_bounds_and_a_kept_revision_needs_none(
    tmp_path: Path,
) -> None:
    """Over LISTEN_S with no block arriving: 1 ms asked gives no more than one per KEEPALIVE_MIN_S, 2**32 - 1
    ms one (at once, the next not before KEEPALIVE_MAX_S), 0 none; each carries nothing. The origin's
    kept revision is served at once without any."""
    listen_s = 0.6
    state = _state(14)
    asked = (0, 1, 100, 2**32 - 1)
    with (
        _origin_and_sidecar(tmp_path, state) as (upstream, manifest, sidecar),
        _setting_up(sidecar, manifest, state, None),
        grpc.insecure_channel(f"{LOOPBACK}:{sidecar.port}") as channel,
    ):
        stub = pb_grpc.WeightStreamServiceStub(channel)

        def heard(ms: int) -> list[pb.StreamRevisionBlocksResponse]:
            request = pb.StreamRevisionBlocksRequest(
                model=MODEL, revision=manifest.revision, tensors=["w"], keepalive_ms=ms
            )
            got: list[pb.StreamRevisionBlocksResponse] = []
            with pytest.raises(grpc.RpcError) as ended:
                got.extend(stub.StreamRevisionBlocks(request, timeout=listen_s))
            assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            return got

        with futures.ThreadPoolExecutor(len(asked)) as pool:
            messages = dict(zip(asked, pool.map(heard, asked), strict=True))
        kept = list(upstream.revision_blocks(MODEL, manifest.revision, ["w"], keepalive_ms=1))
    assert all(m.waiting and not m.data and not m.index for got in messages.values() for m in got), messages
    counts = {ms: len(got) for ms, got in messages.items()}
    assert counts[0] == 0 and counts[2**32 - 1] == 1, counts
    assert 3 <= counts[1] <= listen_s / KEEPALIVE_MIN_S + 2, counts
    assert 2 <= counts[100] <= listen_s / 0.1 + 2, counts
    assert KEEPALIVE_MAX_S > listen_s
    assert [block[0] for block in kept if block is not None] == [0, 1, 2] and None not in kept


@pytest.mark.slow  # a hostile peer's keep-alives for KEEPALIVE_FIRST_BLOCK_STALLS stall times of 0.1 s
def test_a_peer_that_sends_only_keepalives_is_left_at_the_keepalive_cap(tmp_path: Path) -> None:
    """A hostile peer that keeps sending keep-alives (with bytes in them) and never a block is left after
    KEEPALIVE_FIRST_BLOCK_STALLS stall times, not held for ever; its keep-alives count as no bytes."""
    stall = 0.1
    state = _state(15)
    stuffed = pb.StreamRevisionBlocksResponse(waiting=True, index=0, data=b"\x01" * 1024).SerializeToString()

    def chatty(request: pb.StreamRevisionBlocksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        until = time.monotonic() + HOLD_S
        while time.monotonic() < until and context.is_active():
            yield stuffed
            time.sleep(0.005)

    peer, port = serve_blocks(chatty)
    try:
        with _origin_and_sidecar(tmp_path, state) as (upstream, manifest, _):
            report, holdings, seconds = _pull(upstream, manifest, state, f"{LOOPBACK}:{port}", stall)
    finally:
        peer.stop(grace=None)
    assert KEEPALIVE_FIRST_BLOCK_STALLS * stall <= seconds < (KEEPALIVE_FIRST_BLOCK_STALLS + 15) * stall, seconds
    assert holdings.counts.fallbacks == 1
    assert report.peer_bytes == 0 and report.upstream_bytes == NBYTES, report
