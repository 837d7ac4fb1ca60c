"""The fan-out RPCs on a real server on 127.0.0.1: opt-in (--fanout, --peers), stream slots, refusal reports.

GetBlockHashes and StreamRevisionBlocks are served only where fan-out is on: an upstream with
--fanout serves both, a sidecar with --peers only StreamRevisionBlocks (to the peers planned below
it); elsewhere they answer UNIMPLEMENTED. A refused_peer a reader made up stores and logs nothing of
its size. Every wait is bounded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.support.checkpoints import write_model
from tests.support.servers import eventually, loopback_settings, running, serving
from weightstream.client import WeightStreamClient
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

# Larger than any flow-control window: a file read nobody reads stays in flight.
BIG = "fanout-rpcs-big"
PUB = "fanout-rpcs-pub"
ANSWER_TIMEOUT_S = 5.0
HOLD_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fanout-rpcs")
    write_model(folder, BIG, tensors=4, numel=1024 * 1024, seed=4)  # 16 MiB
    return folder


def _code(call: Iterator[object]) -> grpc.StatusCode:
    try:
        list(call)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _published(target: str) -> str:
    state = {"w": torch.arange(3 * 1024 * 1024 // 4, dtype=torch.float32)}
    with WeightStreamClient(target, progress=False) as client:
        return client.publish(PUB, state)


def test_without_fanout_an_upstream_serves_neither_fanout_rpc(root: Path) -> None:
    with running(root, allow_publish=True) as r, grpc.insecure_channel(r.target) as channel:
        revision = _published(r.target)
        stub = pb_grpc.WeightStreamServiceStub(channel)
        hashes = stub.GetBlockHashes(pb.GetBlockHashesRequest(model=PUB, revision=revision), timeout=ANSWER_TIMEOUT_S)
        assert _code(hashes) == grpc.StatusCode.UNIMPLEMENTED
        blocks = stub.StreamRevisionBlocks(
            pb.StreamRevisionBlocksRequest(model=PUB, revision=revision, tensors=["w"]), timeout=ANSWER_TIMEOUT_S
        )
        assert _code(blocks) == grpc.StatusCode.UNIMPLEMENTED


def test_a_sidecar_with_peers_serves_blocks_but_plans_nothing(root: Path) -> None:
    with running(root, allow_publish=True, fanout=True) as upstream:
        revision = _published(upstream.target)
        sidecar_settings = loopback_settings(upstream=upstream.target, peers=True)
        with serving(sidecar_settings) as sidecar, grpc.insecure_channel(f"127.0.0.1:{sidecar.port}") as channel:
            stub = pb_grpc.WeightStreamServiceStub(channel)
            hashes = stub.GetBlockHashes(
                pb.GetBlockHashesRequest(model=PUB, revision=revision), timeout=ANSWER_TIMEOUT_S
            )
            assert _code(hashes) == grpc.StatusCode.UNIMPLEMENTED
            # Served (the revision is neither kept nor arriving at this sidecar yet).
            blocks = stub.StreamRevisionBlocks(
                pb.StreamRevisionBlocksRequest(model=PUB, revision="never-published", tensors=["w"]),
                timeout=ANSWER_TIMEOUT_S,
            )
            assert _code(blocks) == grpc.StatusCode.NOT_FOUND
        with grpc.insecure_channel(upstream.target) as channel:
            stub = pb_grpc.WeightStreamServiceStub(channel)
            hashes = stub.GetBlockHashes(
                pb.GetBlockHashesRequest(model=PUB, revision=revision), timeout=ANSWER_TIMEOUT_S
            )
            assert len(list(hashes)) == 1  # the upstream with --fanout serves them


def test_block_hashes_take_a_stream_slot(root: Path) -> None:
    with running(root, allow_publish=True, fanout=True, max_streams=1) as r:
        revision = _published(r.target)
        eventually(lambda: r.server.stats.active_streams == 0, "the publish's slot free again")
        with grpc.insecure_channel(r.target) as channel:
            stub = pb_grpc.WeightStreamServiceStub(channel)
            read = stub.ReadModelFile(
                pb.ReadModelFileRequest(model=BIG, file="model.safetensors", max_chunk_bytes=64 * 1024),
                timeout=HOLD_TIMEOUT_S,
            )
            try:
                next(read)  # the file read holds the only stream slot, as long as it is not read further
                assert r.server.stats.active_streams == 1
                hashes = stub.GetBlockHashes(
                    pb.GetBlockHashesRequest(model=PUB, revision=revision), timeout=ANSWER_TIMEOUT_S
                )
                assert _code(hashes) == grpc.StatusCode.RESOURCE_EXHAUSTED
            finally:
                read.cancel()
            eventually(lambda: r.server.stats.active_streams == 0, "the file read's slot free again")
            hashes = stub.GetBlockHashes(
                pb.GetBlockHashesRequest(model=PUB, revision=revision), timeout=ANSWER_TIMEOUT_S
            )


def test_a_made_up_refusal_is_neither_kept_nor_logged_whole(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    with (
        running(root, allow_publish=True, fanout=True) as r,
        grpc.insecure_channel(r.target, options=[("grpc.max_send_message_length", 8 * 1024 * 1024)]) as channel,
    ):
        revision = _published(r.target)
        stub = pb_grpc.WeightStreamServiceStub(channel)
        for model in ("m" * (2 * 1024 * 1024), PUB):
            request = pb.StreamRevisionBlocksRequest(
                model=model, revision=revision, tensors=["w"], refused_peer="198.18.0.9:50051"
            )
            code = _code(stub.StreamRevisionBlocks(request, timeout=ANSWER_TIMEOUT_S))
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND)
    assert max(len(record.getMessage()) for record in caplog.records) < 4096
    # This caller is no puller planned below 198.18.0.9: the honest model's report is ignored too.
    assert not any("refused for revision" in record.getMessage() for record in caplog.records)


def test_a_sidecar_with_peers_takes_revisions_from_an_upstream_without_fanout(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = {"w": torch.zeros(1024 * 1024 // 4), "v": torch.ones(16)}
    second = {"w": torch.full((1024 * 1024 // 4,), 2.0), "v": torch.ones(16)}
    third = {"w": torch.full((1024 * 1024 // 4,), 3.0), "v": torch.ones(16)}
    with running(root, allow_publish=True) as upstream:
        with WeightStreamClient(upstream.target, progress=False) as far:
            far.publish(PUB, first)
            with (
                serving(loopback_settings(upstream=upstream.target, peers=True)) as sidecar,
                WeightStreamClient(f"127.0.0.1:{sidecar.port}", progress=False) as near,
            ):
                events = near.watch(PUB)
                next(events)
                for state in (second, third):
                    revision = far.publish(PUB, state)
                    while next(events).revision != revision:
                        pass
                    got = near.load_state_dict(PUB)
                    assert near.manifest(PUB).revision == revision
                    assert all(torch.equal(got[name], state[name]) for name in state)
                events.close()
                relay = sidecar.relay
                assert relay is not None and relay.counts.revisions >= 2
    # Tried once: the upstream's UNIMPLEMENTED is remembered, not met again for every revision.
    assert sum("not taken through peers" in record.getMessage() for record in caplog.records) == 1
