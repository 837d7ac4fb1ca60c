"""The puller's side of fan-out (revisions.peer_pull) against a real upstream with --fanout on 127.0.0.1.

The peers are small gRPC servers in this process: one forwards the upstream's own (correct) blocks,
one every BLOCK_DELAY_S (honest but slow); one takes the call and never sends a block (as a peer whose
link is cut before its first block looks). pull_blocks is called directly with one as the parent (the
upstream never plans a loopback peer itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.support.hostile_peer import serve_blocks
from tests.support.servers import loopback_settings, serving
from weightstream.client import WeightStreamClient
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server.errors import ServerError, status_code
from weightstream_server.revisions import peer_blocks
from weightstream_server.revisions.peer_blocks import CallerLeft, Holdings
from weightstream_server.revisions.peer_pull import FIRST_BLOCK_STALLS, checked_hashes, pull_blocks
from weightstream_server.revisions.store import RevisionStore

MODEL = "fanout-pull"
BLOCKS = 12
BLOCK_DELAY_S = 0.5
STALL_S = 1.0
MIN_RATE = 4 * 1024 * 1024


def _slow_peer(upstream: str) -> tuple[grpc.Server, int]:
    channel = grpc.insecure_channel(upstream)
    stub = pb_grpc.WeightStreamServiceStub(channel)

    def blocks(request: pb.StreamRevisionBlocksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        for response in stub.StreamRevisionBlocks(request):
            time.sleep(BLOCK_DELAY_S)
            yield response.SerializeToString()

    return serve_blocks(blocks)


def test_a_peer_forwarding_slower_than_the_floor_is_left_for_the_upstream(tmp_path: Path) -> None:
    state = {"w": torch.randn(BLOCKS * 1024 * 1024 // 4, generator=torch.Generator().manual_seed(5))}
    with serving(loopback_settings(model_root=tmp_path, allow_publish=True, fanout=True)) as server:
        target = f"127.0.0.1:{server.port}"
        peer, port = _slow_peer(target)
        try:
            with WeightStreamClient(target, progress=False) as upstream:
                revision = upstream.publish(MODEL, state)
                manifest = upstream.manifest(MODEL, revision=revision)
                views = {"w": torch.empty_like(state["w"])}
                holdings = Holdings(RevisionStore())

                opened: list[WeightStreamClient] = []
                closed: list[WeightStreamClient] = []

                class PeerClient(WeightStreamClient):
                    def close(self) -> None:
                        closed.append(self)
                        super().close()

                def connect(address: str) -> WeightStreamClient:
                    opened.append(PeerClient(address, progress=False, retry=None))
                    return opened[-1]

                started = time.monotonic()
                report = pull_blocks(
                    holdings, upstream, connect, manifest, views, ["w"], f"127.0.0.1:{port}", STALL_S, MIN_RATE
                )
                seconds = time.monotonic() - started
                assert report.pull is not None
                holdings.end(report.pull)
        finally:
            peer.stop(grace=None)
    assert torch.equal(views["w"], state["w"])
    assert report.peer_bytes > 0 and report.upstream_bytes > 0, report
    assert holdings.counts.fallbacks == 1
    assert len(opened) == 1 and closed[:1] == opened  # the peer's client, closed after the fallback
    # All from the slow peer would take BLOCKS * BLOCK_DELAY_S.
    assert seconds < BLOCKS * BLOCK_DELAY_S - 1.0, seconds


def test_a_peer_that_never_sends_its_first_block_is_left_within_its_first_block_allowance(tmp_path: Path) -> None:
    """A peer that takes the call and then sends nothing (a link cut before its first block) is left
    after FIRST_BLOCK_STALLS stall times (the allowance for a peer still setting up its own pull), and
    the revision comes whole from the upstream."""
    state = {"w": torch.randn(3 * 1024 * 1024 // 4, generator=torch.Generator().manual_seed(7))}
    released = threading.Event()
    stall = 0.2

    def silent(request: pb.StreamRevisionBlocksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        released.wait(60.0)
        yield from ()

    peer, port = serve_blocks(silent)
    try:
        with (
            serving(loopback_settings(model_root=tmp_path, allow_publish=True, fanout=True)) as server,
            WeightStreamClient(f"127.0.0.1:{server.port}", progress=False) as upstream,
        ):
            revision = upstream.publish(MODEL, state)
            manifest = upstream.manifest(MODEL, revision=revision)
            views = {"w": torch.empty_like(state["w"])}
            holdings = Holdings(RevisionStore())

            def connect(address: str) -> WeightStreamClient:
                return WeightStreamClient(address, progress=False, retry=None)

            started = time.monotonic()
            report = pull_blocks(holdings, upstream, connect, manifest, views, ["w"], f"127.0.0.1:{port}", stall)
            seconds = time.monotonic() - started
            assert report.pull is not None
            holdings.end(report.pull)
    finally:
        released.set()
        peer.stop(grace=None)
    assert torch.equal(views["w"], state["w"])
    assert report.peer_bytes == 0 and report.upstream_bytes == state["w"].numel() * 4, report
    assert holdings.counts.fallbacks == 1
    # Left after the allowance (then the upstream's 3 MiB on loopback), not never.
    assert FIRST_BLOCK_STALLS * stall <= seconds < (FIRST_BLOCK_STALLS + 5) * stall, seconds


def test_a_block_whose_own_source_stalls_here_ends_the_peers_stream_unavailable() -> None:
    holdings = Holdings(RevisionStore())
    pull = holdings.begin(MODEL, "r1", {"w": torch.zeros(2 * 1024 * 1024 // 4)})
    try:
        pull.advance("w", 1)  # block 0 arrived here, block 1 never does
        blocks = holdings.blocks(MODEL, "r1", ["w"], 0, 0.2)
        assert next(blocks)[0] == 0
        with pytest.raises(ServerError) as raised:
            next(blocks)
        # Not DEADLINE_EXCEEDED: that would say the peer asking did not send in time.
        assert status_code(raised.value) == grpc.StatusCode.UNAVAILABLE
    finally:
        holdings.end(pull)


def test_a_request_waiting_here_for_a_block_or_a_revision_ends_once_its_caller_has_left() -> None:
    """The serving side of a peer whose puller left (it fell back to the upstream) stops waiting within
    a fraction of a second, not at the stall time or ARRIVAL_S, which here only the caller's leaving
    could end (a 60 s stall time; a revision expected here, which waits 30 s for its pull)."""
    holdings = Holdings(RevisionStore())
    pull = holdings.begin(MODEL, "r1", {"w": torch.zeros(2 * 1024 * 1024 // 4)})
    holdings.expect(MODEL, "r2")
    try:
        pull.advance("w", 1)  # block 0 arrived here, block 1 never does
        for revision, served in (("r1", 1), ("r2", 0)):
            there = threading.Event()
            there.set()
            blocks = holdings.blocks(MODEL, revision, ["w"], 0, 60.0, there.is_set)
            assert [next(blocks)[0] for _ in range(served)] == list(range(served))
            threading.Timer(0.3, there.clear).start()
            started = time.monotonic()
            with pytest.raises(CallerLeft):
                next(blocks)
            assert time.monotonic() - started < 2.0, revision
    finally:
        holdings.end(pull)


def test_a_revision_with_an_empty_tensor_is_pulled_through_a_peer(tmp_path: Path) -> None:
    """An empty tensor has no blocks on either side (the upstream's hashes, a peer's stream): its hashes
    add up to the digest and the pull takes the rest of the revision from the peer, bit-exact."""
    state = {
        "empty": torch.empty(0, 4),
        "w": torch.randn(3 * 1024 * 1024 // 4 + 5, generator=torch.Generator().manual_seed(9)),
    }
    with serving(loopback_settings(model_root=tmp_path, allow_publish=True, fanout=True)) as server:
        target = f"127.0.0.1:{server.port}"
        with WeightStreamClient(target, progress=False) as upstream:
            revision = upstream.publish(MODEL, state)
            manifest = upstream.manifest(MODEL, revision=revision)
            hashes = upstream.block_hashes(MODEL, revision)
            assert hashes["empty"] == () and len(hashes["w"]) == 4
            checked_hashes(manifest, hashes)  # raises unless they are whole and give the digest
            assert [block.number for block in upstream.revision_blocks(MODEL, revision, ["empty", "w"]) if block] == [
                0,
                1,
                2,
                3,
            ]
            # The upstream (--fanout) serves its own blocks as a peer: the pull takes them all from it.
            views = {name: torch.empty_like(tensor) for name, tensor in state.items()}
            holdings = Holdings(RevisionStore())

            def connect(address: str) -> WeightStreamClient:
                return WeightStreamClient(address, progress=False, retry=None)

            report = pull_blocks(holdings, upstream, connect, manifest, views, ["empty", "w"], target, STALL_S, 0)
            assert report.pull is not None
            holdings.end(report.pull)
    assert all(torch.equal(views[name], state[name]) for name in state)
    assert holdings.counts.fallbacks == 0 and report.peer_bytes == state["w"].numel() * 4, report


def test_a_request_waits_for_a_pulls_first_block_as_long_as_the_pull_itself_may(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A peer's request for a pull here whose own first block comes late (its own peer still setting
    up) is served once it comes, past ARRIVAL_S, and fails UNAVAILABLE only once the pull itself would
    have given up (first_block_s); a chain whose upper nodes start late is not cut by the serving side.
    ARRIVAL_S is made short here, as is first_block_s, so that the test takes seconds."""
    monkeypatch.setattr(peer_blocks, "ARRIVAL_S", 0.3)
    holdings = Holdings(RevisionStore(), first_block_s=1.5)
    pull = holdings.begin(MODEL, "r1", {"w": torch.zeros(2 * 1024 * 1024 // 4)})
    try:
        threading.Timer(0.8, pull.advance, ("w", 1)).start()  # past ARRIVAL_S, within first_block_s
        started = time.monotonic()
        block = next(holdings.blocks(MODEL, "r1", ["w"], 0, 0.1))
        assert block is not None and block.number == 0 and len(block.data) == 1024 * 1024
        assert 0.7 < time.monotonic() - started < 1.4
        # Block 1 never comes, and the pull has flowed: the request's own stall time holds.
        blocks = holdings.blocks(MODEL, "r1", ["w"], 1, 0.2)
        started = time.monotonic()
        with pytest.raises(ServerError) as raised:
            next(blocks)
        assert status_code(raised.value) == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 1.0
    finally:
        holdings.end(pull)
    # A pull whose first block never comes: the wait ends at first_block_s, not before.
    pull = holdings.begin(MODEL, "r2", {"w": torch.zeros(1024 * 1024 // 4)})
    try:
        started = time.monotonic()
        with pytest.raises(ServerError) as raised:
            next(holdings.blocks(MODEL, "r2", ["w"], 0, 0.1))
        assert status_code(raised.value) == grpc.StatusCode.UNAVAILABLE
        assert 1.4 < time.monotonic() - started < 3.0
    finally:
        holdings.end(pull)
