"""A swarm pull (revisions.peer_pull.pull_blocks with sources) against a real upstream with --fanout on 127.0.0.1.

Each puller's Holdings is served by a small gRPC server in this process whose StreamRevisionBlocks is
Holdings.blocks itself (what a sidecar serves to peers), so that pullers take groups from each other
while they pull. pull_blocks is called directly with loopback sources (the upstream never plans a
loopback peer itself). A hostile source (one byte of each block flipped) and a dead one stand in for
failed peers.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import torch

from tests.support.hostile_peer import serve_blocks
from tests.support.ports import LOOPBACK, free_ports
from tests.support.servers import loopback_settings, serving
from weightstream.client import WeightStreamClient
from weightstream.client.manifest import Manifest
from weightstream.protocol.digests import DIGEST_BLOCK_BYTES
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server.revisions.peer_blocks import Holdings
from weightstream_server.revisions.peer_pull import PullReport, pull_blocks, swarm_groups
from weightstream_server.revisions.store import RevisionStore

MODEL = "fanout-swarm"
STALL_S = 3.0
# Eight 1 MiB tensors: groups of two blocks' tensors each at four groups.
TENSORS = 8
# The address the failed sources are named by (dialled on 127.0.0.1): a refused_peer report the upstream
# takes (it refuses to hear of a loopback peer, which it never plans).
PLANNED = "198.18.0.1"


def _state() -> dict[str, torch.Tensor]:
    noise = torch.Generator().manual_seed(11)
    return {f"t{i}": torch.randn(DIGEST_BLOCK_BYTES // 4, generator=noise) for i in range(TENSORS)}


def _connect(address: str) -> WeightStreamClient:
    return WeightStreamClient(address.replace(PLANNED, LOOPBACK), progress=False, retry=None)


def _bytes(manifest: Manifest, names: Sequence[str]) -> int:
    return sum(manifest.by_name[name].nbytes for name in names)


@contextlib.contextmanager
def _served(holdings: Holdings, asked: list[tuple[str, ...]]) -> Iterator[str]:
    """holdings served to peers on 127.0.0.1 (the tensor names of each request noted in asked): its address."""

    def blocks(request: pb.StreamRevisionBlocksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        asked.append(tuple(request.tensors))
        for block in holdings.blocks(
            request.model,
            request.revision,
            list(request.tensors),
            request.first_block,
            STALL_S,
            context.is_active,
            wanted=request.wanted,
            since=request.since,
        ):
            assert block is not None  # no keep-alives asked for
            message = pb.StreamRevisionBlocksResponse(index=block.number, data=block.data, encoding=block.encoding)
            yield message.SerializeToString()

    server, port = serve_blocks(blocks)
    try:
        yield f"{LOOPBACK}:{port}"
    finally:
        server.stop(grace=None)


def _pull_all(
    upstream: WeightStreamClient, manifest: Manifest, state: dict[str, torch.Tensor], plans: list[list[str]]
) -> tuple[list[tuple[PullReport, Holdings]], list[list[tuple[str, ...]]]]:
    """One pull per plan (its sources, "" for the upstream; "@k" for puller k's address), all at once, each
    checked bit-exact: each one's report and holdings, and the tensor names of each request each was asked."""
    holdings = [Holdings(RevisionStore()) for _ in plans]
    asked: list[list[tuple[str, ...]]] = [[] for _ in plans]
    results: list[tuple[PullReport, Holdings, dict[str, torch.Tensor]] | None] = [None] * len(plans)
    with contextlib.ExitStack() as stack:
        addresses = [stack.enter_context(_served(h, a)) for h, a in zip(holdings, asked, strict=True)]

        def pull(k: int) -> None:
            sources = [addresses[int(s[1:])] if s.startswith("@") else s for s in plans[k]]
            views = {name: torch.empty_like(tensor) for name, tensor in state.items()}
            report = pull_blocks(
                holdings[k], upstream, _connect, manifest, views, list(state), "", STALL_S, sources=sources
            )
            results[k] = (report, holdings[k], views)

        threads = [threading.Thread(target=pull, args=(k,)) for k in range(len(plans))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # Ended only once every puller is done: each one's blocks are served to the others until then.
        for result in results:
            assert result is not None and result[0].pull is not None
            result[1].end(result[0].pull)
    for result in results:
        assert result is not None
        for name, tensor in state.items():
            assert torch.equal(result[2][name], tensor), name
    return [(r[0], r[1]) for r in results if r is not None], asked


def test_a_swarm_takes_each_group_from_its_owner_and_the_upstream_sends_one_copy(tmp_path: Path) -> None:
    """Three owners (each its group from the upstream, the others from each other) and a fourth puller
    that takes every group from a peer that does not own it but pulls it: every pull bit-exact."""
    state = _state()
    with (
        serving(loopback_settings(model_root=tmp_path, allow_publish=True, fanout=True)) as origin,
        WeightStreamClient(f"{LOOPBACK}:{origin.port}", progress=False) as upstream,
    ):
        manifest = upstream.manifest(MODEL, revision=upstream.publish(MODEL, state))
        plans = [["", "@1", "@2"], ["@0", "", "@2"], ["@0", "@1", ""], ["@1", "@2", "@0"]]
        results, asked = _pull_all(upstream, manifest, state, plans)
        assert origin.holdings is not None
        served = origin.holdings.counts.served_bytes
    groups = swarm_groups(manifest, 3)
    for k, (report, holdings) in enumerate(results[:3]):
        own = _bytes(manifest, groups[k])
        assert report.upstream_bytes == own and report.peer_bytes == manifest.total_bytes - own, (k, report)
        assert holdings.counts.fallbacks == 0 and not report.refused
        assert sorted(report.known) == sorted(state)
    fourth = results[3][0]
    assert fourth.upstream_bytes == 0 and fourth.peer_bytes == manifest.total_bytes, fourth
    # Each owner was asked for its group by the two other owners, and for another group by the fourth.
    for k in range(3):
        assert sorted(asked[k]) == sorted([tuple(groups[k])] * 2 + [tuple(groups[(k + 2) % 3])]), (k, asked[k])
    assert served == manifest.total_bytes  # one copy from the upstream


def test_a_hostile_or_dead_source_leaves_only_its_own_group_to_the_upstream(tmp_path: Path) -> None:
    state = _state()
    with (
        serving(loopback_settings(model_root=tmp_path, allow_publish=True, fanout=True)) as origin,
        WeightStreamClient(f"{LOOPBACK}:{origin.port}", progress=False) as upstream,
    ):
        manifest = upstream.manifest(MODEL, revision=upstream.publish(MODEL, state))
        stub = pb_grpc.WeightStreamServiceStub(grpc.insecure_channel(f"{LOOPBACK}:{origin.port}"))

        def relay(flip: bool) -> Callable[[pb.StreamRevisionBlocksRequest, grpc.ServicerContext], Iterator[bytes]]:
            def blocks(request: pb.StreamRevisionBlocksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
                for response in stub.StreamRevisionBlocks(request):
                    data = bytearray(response.data)
                    data[len(data) // 2] ^= 0x5A if flip else 0
                    yield pb.StreamRevisionBlocksResponse(index=response.index, data=bytes(data)).SerializeToString()

            return blocks

        honest, honest_port = serve_blocks(relay(False))
        hostile, hostile_port = serve_blocks(relay(True))
        try:
            sources = ["", f"{LOOPBACK}:{honest_port}", f"{PLANNED}:{hostile_port}", f"{PLANNED}:{free_ports(1)[0]}"]
            holdings = Holdings(RevisionStore())
            views = {name: torch.empty_like(tensor) for name, tensor in state.items()}
            report = pull_blocks(
                holdings, upstream, _connect, manifest, views, list(state), "", STALL_S, sources=sources
            )
            assert report.pull is not None
            holdings.end(report.pull)
        finally:
            honest.stop(grace=None)
            hostile.stop(grace=None)
    for name, tensor in state.items():
        assert torch.equal(views[name], tensor), name
    groups = swarm_groups(manifest, 4)
    assert report.peer_bytes == _bytes(manifest, groups[1]), report
    assert report.upstream_bytes == manifest.total_bytes - _bytes(manifest, groups[1]), report
    assert report.refused == f"{PLANNED}:{hostile_port}"
    assert holdings.counts.fallbacks == 2 and holdings.counts.refused_blocks == 1
