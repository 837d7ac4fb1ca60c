"""retry.decide_retry on real gRPC failures: a port nothing listens on, and a server that refuses a request."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.checkpoints import write_model
from tests.support.ports import free_ports
from weightstream.client.errors import UnavailableError
from weightstream.client.retry import Outage, RetryDecision, RetryPolicy, decide_retry, status_of
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

MODEL = "retried"


def _failure(target: str, model: str) -> grpc.RpcError:
    """The error a real GetManifest call ends with (UNAVAILABLE where nothing listens)."""
    with grpc.insecure_channel(target) as channel:
        try:
            pb_grpc.WeightStreamServiceStub(channel).GetManifest(pb.GetManifestRequest(model=model), timeout=5)
        except grpc.RpcError as exc:
            return exc
    raise AssertionError(f"GetManifest({model!r}) on {target} succeeded")


@pytest.fixture(scope="module")
def refused() -> grpc.RpcError:
    (port,) = free_ports(1)
    return _failure(f"127.0.0.1:{port}", MODEL)


@pytest.fixture(scope="module")
def not_found(stub_target: str, root: Path) -> Iterator[grpc.RpcError]:
    write_model(root, MODEL, tensors=1, numel=16, seed=1)
    yield _failure(stub_target, "no-such-model")


def decide(exc: grpc.RpcError, outage: Outage | None) -> RetryDecision:
    return decide_retry(
        exc, idle=False, replaced=False, outage=outage, model=MODEL, target="t", missing_bytes=lambda: 64
    )


def test_no_server_is_a_wait_not_a_try(refused: grpc.RpcError) -> None:
    assert status_of(refused)[0] == grpc.StatusCode.UNAVAILABLE
    outage = Outage(RetryPolicy(attempts=1))
    decision = decide(refused, outage)
    assert decision.reached is False and decision.delay >= 0
    assert outage.failures == 0, "a failure that found no server is not a try"


def test_without_a_policy_the_error_is_raised_as_it_came(refused: grpc.RpcError) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        decide(refused, None)
    assert raised.value is refused


def test_an_outage_spent_names_the_model_the_tries_and_what_is_missing(refused: grpc.RpcError) -> None:
    outage = Outage(RetryPolicy(attempts=1, total_deadline=0.001))
    decide(refused, outage)  # the outage starts
    time.sleep(0.01)
    with pytest.raises(UnavailableError, match=r"model 'retried': .*gave up after 0 tries in .* with 64 bytes missing"):
        decide(refused, outage)


def test_a_refusal_is_not_retried_and_an_idle_stream_is(not_found: grpc.RpcError) -> None:
    assert status_of(not_found)[0] == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as raised:
        decide(not_found, Outage(RetryPolicy()))
    assert raised.value is not_found
    idle = decide_retry(
        not_found, idle=True, replaced=False, outage=Outage(RetryPolicy()), model=MODEL, target="t", missing_bytes=int
    )
    assert idle.reached is True and idle.what.startswith("no message for 60 s")
    spent = Outage(RetryPolicy(attempts=1))
    with pytest.raises(UnavailableError, match="no message for 60 s"):
        decide_retry(not_found, idle=True, replaced=False, outage=spent, model=MODEL, target="t", missing_bytes=int)
