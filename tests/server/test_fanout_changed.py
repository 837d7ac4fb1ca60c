"""Fan-out of a revision that changed only in part: blocks copied from the revision held, deltas between peers.

An origin (--fanout) on 127.0.0.1 publishes a revision H and then R, which differs from H in some
blocks. pull_blocks is called directly with a loopback parent (the origin never plans a loopback
peer itself): the origin, a sidecar (--peers) that relayed both revisions, or a gRPC server in this
process that answers StreamRevisionBlocks the way an older or a hostile peer would. The puller holds
H as Held (its bytes and block checks, as the relay builds it from a kept revision). Every pull must
end bit-exact, with the (CRC32C, BLAKE3) of every block right in what it reports as known.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from tests.support.hostile_peer import serve_blocks
from tests.support.ports import LOOPBACK
from tests.support.servers import loopback_settings, serving
from weightstream.client import WeightStreamClient
from weightstream.client.manifest import Manifest
from weightstream.protocol import deltas, digests, wire
from weightstream.protocol.digests import DIGEST_BLOCK_BYTES
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server import WeightStreamServer
from weightstream_server.revisions.peer_blocks import Holdings, wanted_at
from weightstream_server.revisions.peer_pull import Held, HeldTensor, PullReport, pull_blocks
from weightstream_server.revisions.store import RevisionStore

MODEL = "fanout-changed"
BLOCKS = 20
ELEMENTS = BLOCKS * DIGEST_BLOCK_BYTES // 4
STALL_S = 2.0
# Blocks of R that differ from H (10%).
CHANGED = (3, 14)
# The address a hostile peer is named by (dialled on 127.0.0.1): a refused_peer report the origin
# takes (it refuses to hear of a loopback peer, which it never plans).
PLANNED = "198.18.0.1"


def _held_state() -> dict[str, torch.Tensor]:
    return {
        "w": torch.randn(ELEMENTS, generator=torch.Generator().manual_seed(1)),
        "b": torch.randn(1000, generator=torch.Generator().manual_seed(2)),
    }


def _changed_blocks(held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """held with CHANGED blocks of w rewritten whole, and b unchanged."""
    state = {name: tensor.clone() for name, tensor in held.items()}
    per_block = DIGEST_BLOCK_BYTES // 4
    noise = torch.Generator().manual_seed(3)
    for j in CHANGED:
        state["w"][j * per_block : (j + 1) * per_block] = torch.randn(per_block, generator=noise)
    return state


def _few_elements(held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """held with 8 elements changed in every block of w: each block a small delta."""
    state = {name: tensor.clone() for name, tensor in held.items()}
    per_block = DIGEST_BLOCK_BYTES // 4
    for j in range(BLOCKS):
        state["w"][j * per_block + 1000 : j * per_block + 1008] += 1.0
    return state


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _checks(tensor: torch.Tensor) -> list[tuple[int, bytes]]:
    """(CRC32C, BLAKE3) of each block of tensor."""
    data = _flat(tensor).numpy().tobytes()
    step = DIGEST_BLOCK_BYTES
    return [
        (wire.crc32c(data[i : i + step]), digests.block_hash(data[i : i + step])) for i in range(0, len(data), step)
    ]


def _held(revision: str, state: dict[str, torch.Tensor]) -> Held:
    tensors = {}
    for name, tensor in state.items():
        checks = _checks(tensor)
        tensors[name] = HeldTensor(_flat(tensor), [c for c, _ in checks], [h for _, h in checks])
    return Held(revision, tensors)


def _connect(address: str) -> WeightStreamClient:
    return WeightStreamClient(address.replace(PLANNED, LOOPBACK), progress=False, retry=None)


@contextlib.contextmanager
def _origin(tmp_path: Path) -> Iterator[tuple[WeightStreamServer, WeightStreamClient]]:
    with serving(loopback_settings(model_root=tmp_path, allow_publish=True, fanout=True)) as origin:
        with WeightStreamClient(f"{LOOPBACK}:{origin.port}", progress=False) as upstream:
            yield origin, upstream


def _pull(
    upstream: WeightStreamClient,
    manifest: Manifest,
    state: dict[str, torch.Tensor],
    parent: str,
    held: Held | None,
    use_deltas: bool = True,
) -> tuple[PullReport, Holdings]:
    """pull_blocks of state's tensors from parent, holding held; checked bit-exact, with the right known checks."""
    holdings = Holdings(RevisionStore(), 64 * DIGEST_BLOCK_BYTES)
    views = {name: torch.empty_like(tensor) for name, tensor in state.items()}
    report = pull_blocks(
        holdings, upstream, _connect, manifest, views, list(state), parent, STALL_S, 0.0, held, use_deltas
    )
    assert report.pull is not None
    holdings.end(report.pull)
    for name, tensor in state.items():
        assert torch.equal(views[name], tensor), name
        assert report.known[name] == _checks(tensor), name
    return report, holdings


def _published(upstream: WeightStreamClient, *states: dict[str, torch.Tensor]) -> list[Manifest]:
    return [upstream.manifest(MODEL, revision=upstream.publish(MODEL, state)) for state in states]


def test_a_revision_with_a_tenth_of_its_blocks_changed_takes_only_those_from_the_peer(tmp_path: Path) -> None:
    """The blocks of R whose hashes equal H's are copied from H; only the changed ones cross the wire."""
    h_state = _held_state()
    r_state = _changed_blocks(h_state)
    with _origin(tmp_path) as (origin, upstream):
        h, r = _published(upstream, h_state, r_state)
        report, holdings = _pull(upstream, r, r_state, f"{LOOPBACK}:{origin.port}", _held(h.revision, h_state))
    changed = len(CHANGED) * DIGEST_BLOCK_BYTES
    assert report.peer_bytes == changed and report.upstream_bytes == 0, report
    assert report.copied_bytes == r.total_bytes - changed, report
    # Whole random blocks: no delta saves a quarter, they travel raw.
    assert report.peer_wire_bytes == changed and report.delta_blocks == 0, report
    assert holdings.counts.fallbacks == 0 and holdings.counts.refused_blocks == 0
    assert origin.holdings is not None and origin.holdings.counts.served_bytes == changed


def test_a_small_change_travels_as_deltas_and_a_relay_forwards_them_without_encoding_again(tmp_path: Path) -> None:
    """A sidecar takes R from the origin (its relay: H's blocks as the base of deltas the origin encodes);
    a puller holding H takes R from the sidecar: the same deltas, forwarded, none encoded there."""
    h_state = _held_state()
    r_state = _few_elements(h_state)
    with _origin(tmp_path) as (origin, upstream):
        (h,) = _published(upstream, h_state)
        with (
            serving(loopback_settings(upstream=f"{LOOPBACK}:{origin.port}", peers=True)) as sidecar,
            WeightStreamClient(f"{LOOPBACK}:{sidecar.port}", progress=False) as below,
        ):
            assert below.manifest(MODEL).revision == h.revision  # the sidecar follows the model and holds H
            assert sidecar.relay is not None and sidecar.holdings is not None and origin.holdings is not None
            counts = sidecar.holdings.counts
            before = (counts.upstream_bytes, counts.upstream_wire_bytes, origin.holdings.counts.served_bytes)
            (r,) = _published(upstream, r_state)
            assert sidecar.revisions is not None and sidecar.revisions.wait_for(MODEL, r.revision, 30.0)
            raw = r_state["w"].numel() * 4
            # The sidecar's relay asked the origin for the changed blocks with since H: deltas.
            assert counts.upstream_bytes - before[0] == raw
            wire_bytes = counts.upstream_wire_bytes - before[1]
            assert wire_bytes < raw // 100 and origin.holdings.counts.served_bytes - before[2] == wire_bytes
            # b did not change: shared with H, neither copied nor asked for.
            assert counts.copied_bytes == 0 and sidecar.relay.counts.shared_bytes > 0
            assert origin.holdings.counts.encoded_blocks == BLOCKS
            report, _ = _pull(upstream, r, r_state, f"{LOOPBACK}:{sidecar.port}", _held(h.revision, h_state))
            assert sidecar.holdings.counts.encoded_blocks == 0  # forwarded as received
            assert sidecar.holdings.counts.served_deltas == BLOCKS
    assert report.delta_blocks == BLOCKS and report.peer_bytes == raw, report
    assert report.peer_wire_bytes < raw // 20, report
    assert origin.holdings.counts.encoded_blocks == BLOCKS  # once per block, not per puller


def test_an_older_puller_gets_every_block_raw(tmp_path: Path) -> None:
    """A request with neither wanted nor since (a puller that predates them) gets every block, raw."""
    h_state = _held_state()
    r_state = _few_elements(h_state)
    with _origin(tmp_path) as (origin, upstream):
        _, r = _published(upstream, h_state, r_state)
        got = list(upstream.revision_blocks(MODEL, r.revision, ["w", "b"]))
        assert origin.holdings is not None and origin.holdings.counts.encoded_blocks == 0
    assert all(block is not None and not block.encoding for block in got)
    data = b"".join(block.data for block in got if block is not None)
    assert data == _flat(r_state["w"]).numpy().tobytes() + _flat(r_state["b"]).numpy().tobytes()


Answer = Callable[[pb.StreamRevisionBlocksRequest, pb.StreamRevisionBlocksResponse], pb.StreamRevisionBlocksResponse]


def _delta(h_state: dict[str, torch.Tensor], wrong: bool, padded: bool = False) -> Answer:
    """The first block as a delta against H: one that decodes to R's block, or (wrong) to other bytes (one
    bit of the XOR flipped), or (padded) a right one followed by a zstd skippable frame that makes it
    larger than any delta worth sending (it decodes the same: a relay would keep and forward the padding)."""

    def answer(
        request: pb.StreamRevisionBlocksRequest, response: pb.StreamRevisionBlocksResponse
    ) -> pb.StreamRevisionBlocksResponse:
        j = response.index
        start = j * DIGEST_BLOCK_BYTES
        base = _flat(h_state["w"])[start : start + DIGEST_BLOCK_BYTES]
        if response.encoding:
            payload = np.frombuffer(response.data, dtype=np.uint8)  # held while decoded
            codec = deltas.Codec()
            decoded = codec.decode(base.numel(), start, payload.ctypes.data, payload.size, response.encoding)
            new = base.clone()
            decoded.xor_into(new)
        else:
            new = torch.frombuffer(bytearray(response.data), dtype=torch.uint8)
        xor = new ^ base
        if wrong:
            xor[7] ^= 1
        encoded = deltas.Codec().encode(xor, start)
        assert encoded is not None
        data = encoded[1]
        if padded:
            size = DIGEST_BLOCK_BYTES * 7 // 8 - len(data)
            data += b"\x50\x2a\x4d\x18" + size.to_bytes(4, "little") + bytes(size)
        return pb.StreamRevisionBlocksResponse(index=j, encoding=encoded[0], data=data)

    return answer


def _undecodable(
    request: pb.StreamRevisionBlocksRequest, response: pb.StreamRevisionBlocksResponse
) -> pb.StreamRevisionBlocksResponse:
    return pb.StreamRevisionBlocksResponse(
        index=response.index, encoding=pb.CHUNK_ENCODING_XOR_ZSTD, data=b"\x28\xb5\x2f\xfd not zstd"
    )


def _unasked(
    request: pb.StreamRevisionBlocksRequest, response: pb.StreamRevisionBlocksResponse
) -> pb.StreamRevisionBlocksResponse:
    """The block wanted, right, but numbered as the next one not wanted: only its number tells it apart."""
    j = next(i for i in range(response.index, BLOCKS) if not wanted_at(request.wanted, i))
    return pb.StreamRevisionBlocksResponse(index=j, data=response.data)


def _hostile(upstream_port: int, answer: Answer) -> tuple[grpc.Server, int, list[pb.StreamRevisionBlocksRequest]]:
    """A peer that asks the origin for what it is asked and answers its first block with answer's."""
    stub = pb_grpc.WeightStreamServiceStub(grpc.insecure_channel(f"{LOOPBACK}:{upstream_port}"))
    asked: list[pb.StreamRevisionBlocksRequest] = []

    def blocks(request: pb.StreamRevisionBlocksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        asked.append(request)
        for n, response in enumerate(stub.StreamRevisionBlocks(request)):
            yield (answer(request, response) if n == 0 else response).SerializeToString()

    server, port = serve_blocks(blocks)
    return server, port, asked


@pytest.mark.parametrize("kind", ["wrong_delta", "undecodable", "unasked", "delta_unasked_for", "padded_delta"])
def test_a_hostile_peers_delta_or_block_is_refused_and_the_rest_comes_from_the_upstream(
    tmp_path: Path, kind: str
) -> None:
    """A delta that decodes to wrong bytes, one that does not decode, a block not asked for, a delta (even
    a right one) to a puller that named no since, or a right delta padded past what any delta worth sending
    takes: refused, counted, the rest from the origin, bit-exact."""
    h_state = _held_state()
    r_state = _few_elements(h_state) if kind != "unasked" else _changed_blocks(h_state)
    answers: dict[str, Answer] = {
        "wrong_delta": _delta(h_state, wrong=True),
        "undecodable": _undecodable,
        "unasked": _unasked,
        "delta_unasked_for": _delta(h_state, wrong=False),
        "padded_delta": _delta(h_state, wrong=False, padded=True),
    }
    with _origin(tmp_path) as (origin, upstream):
        h, r = _published(upstream, h_state, r_state)
        peer, port, asked = _hostile(origin.port, answers[kind])
        try:
            # delta_unasked_for: a puller that holds H but asks for no deltas (no since).
            held = _held(h.revision, h_state)
            report, holdings = _pull(upstream, r, r_state, f"{PLANNED}:{port}", held, kind != "delta_unasked_for")
        finally:
            peer.stop(grace=None)
    assert holdings.counts.refused_blocks == 1 and holdings.counts.fallbacks == 1, holdings.counts
    assert report.refused == f"{PLANNED}:{port}" and report.peer_bytes == 0, report
    assert asked[0].since == (h.revision if kind != "delta_unasked_for" else "")
    if kind == "unasked":
        assert report.upstream_bytes == len(CHANGED) * DIGEST_BLOCK_BYTES, report  # only the changed blocks


def test_an_older_peer_that_sends_every_block_raw_is_kept_and_the_pull_ends_bit_exact(tmp_path: Path) -> None:
    """A peer that predates wanted and since (its requests reach the origin without them) sends every
    block from first_block, raw: those copied here already are dropped unread, the changed ones taken
    from it, nothing refused, nothing from the origin."""
    h_state = _held_state()
    r_state = _changed_blocks(h_state)
    stubs: list[pb_grpc.WeightStreamServiceStub] = []

    with _origin(tmp_path) as (origin, upstream):
        h, r = _published(upstream, h_state, r_state)
        stubs.append(pb_grpc.WeightStreamServiceStub(grpc.insecure_channel(f"{LOOPBACK}:{origin.port}")))

        def older(request: pb.StreamRevisionBlocksRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
            request.ClearField("wanted")
            request.ClearField("since")
            for response in stubs[0].StreamRevisionBlocks(request):
                yield response.SerializeToString()

        peer, port = serve_blocks(older)
        try:
            started = time.monotonic()
            report, holdings = _pull(upstream, r, r_state, f"{PLANNED}:{port}", _held(h.revision, h_state))
            seconds = time.monotonic() - started
        finally:
            peer.stop(grace=None)
    # Every changed block came from it; the unchanged ones after the first changed one came too, unread.
    assert report.peer_bytes == len(CHANGED) * DIGEST_BLOCK_BYTES and report.upstream_bytes == 0, report
    total = sum(tensor.numel() * tensor.element_size() for tensor in r_state.values())
    assert report.peer_wire_bytes == total - min(CHANGED) * DIGEST_BLOCK_BYTES, report
    assert holdings.counts.refused_blocks == 0 and holdings.counts.fallbacks == 0
    assert report.refused == ""
    assert seconds < 10 * STALL_S, seconds


def test_pullers_asking_at_once_with_the_same_since_cost_one_encoding_per_block(tmp_path: Path) -> None:
    """Four requests for R since H at the same moment (a tree's children, or several roots): each block
    is encoded once on the origin, and all four get the same deltas."""
    h_state = _held_state()
    r_state = _few_elements(h_state)
    with _origin(tmp_path) as (origin, upstream):
        h, r = _published(upstream, h_state, r_state)
        barrier = threading.Barrier(4)

        def ask(_: int) -> list[tuple[int, bytes, int]]:
            with WeightStreamClient(f"{LOOPBACK}:{origin.port}", progress=False) as client:
                barrier.wait(10.0)
                return [tuple(b) for b in client.revision_blocks(MODEL, r.revision, ["w"], since=h.revision) if b]

        with futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, range(4)))
        assert origin.holdings is not None
        assert origin.holdings.counts.encoded_blocks == BLOCKS
        assert origin.holdings.counts.served_deltas == 4 * BLOCKS
    assert got[0] == got[1] == got[2] == got[3] and len(got[0]) == BLOCKS
