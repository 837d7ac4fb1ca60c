"""Property tests with hypothesis: hostile inputs on every RPC and frame type, against one real server.

Each surface of tests/support/surfaces.py (publishes over gRPC and over the data port, tensor
streams over gRPC and the data port, data-port handshakes, GetChanges and WatchModel, request
bytes that are no valid message, delta payloads) gets a few dozen cases, the same on every run
(derandomize). A case fails when the server answers outside the surface's allowed codes (never
UNKNOWN or INTERNAL), serves bytes that fail their CRC32C or are not the revision's, takes a bad
publish or refuses a good one; after each surface a good client must load a good model bit for bit,
over gRPC and the data port. benchmarks/fuzz_surfaces.py runs the same surfaces with thousands of
cases each.

Two more properties pin bugs that were fixed in revisions/ (found by these cases' first version):
a publish stream that ends without commit is refused, never answered OK; and tensors of any size
publish and load bit for bit (a part whose tensors but the last were not multiples of 64 bytes
overflowed its buffer: that test runs against a `weightstream serve` process, whose memory a
regression may corrupt).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from tests.support.ports import LOOPBACK, free_ports
from tests.support.reliability_report import record
from tests.support.serve_processes import serve_process, wait_grpc_ready
from tests.support.surfaces import (
    CALL_TIMEOUT_S,
    GOOD,
    LAYOUT,
    NEW,
    PUBLISH_CODES,
    SURFACES,
    Announced,
    PublishCase,
    Target,
    make_plans,
    outcome,
    random_tensors,
    raw_bytes,
    state_of,
    target_at,
)
from weightstream.client import WeightStreamClient
from weightstream.v1 import weightstream_pb2 as pb

pytestmark = pytest.mark.slow

CASES = settings(
    max_examples=50,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Outcomes each surface must reach in its cases, or its generator tests too little.
MUST_SEE = {
    "publish": {"OK", "INVALID_ARGUMENT"},
    "publish_frames": {"OK", "INVALID_ARGUMENT"},
    "stream": {"OK", "INVALID_ARGUMENT"},
    "bulk_stream": {"OK", "INVALID_ARGUMENT"},
    "hello": {"CLOSED"},
    "revisions": {"OK", "INVALID_ARGUMENT"},
    "raw_bytes": {"INVALID_ARGUMENT"},
    "deltas": {"APPLIED", "UNUSABLE"},
    "peer_blocks": {"OK", "OK_DELTAS", "INVALID_ARGUMENT", "NOT_FOUND"},
}


@pytest.fixture(scope="module")
def target(root: Path) -> Iterator[Target]:
    with target_at(root) as target:
        yield target


@pytest.fixture
def still_serving(target: Target) -> Iterator[None]:
    """After the test body, a good client loads the good model bit for bit."""
    yield
    target.check_good_load()


# In this order: the publishes come first, so that the streams and changes meet published revisions.
@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize("name", list(SURFACES))
def test_every_case_of_a_surface_ends_with_an_allowed_outcome(target: Target, name: str) -> None:
    surface = SURFACES[name]
    seen: Counter[str] = Counter()

    @CASES
    @given(surface.cases)
    def run(case: Any) -> None:
        seen[surface.run(target, case)] += 1

    try:
        run()
    finally:
        record("properties", **{f"{name}_cases": sum(seen.values())})
    assert set(seen) <= surface.allowed, seen
    assert MUST_SEE[name] <= set(seen), f"{name}: the cases reached only {dict(seen)}"


@pytest.mark.usefixtures("still_serving")
def test_a_publish_stream_that_ends_without_commit_is_refused(target: Target) -> None:
    @settings(CASES, max_examples=10, phases=[Phase.explicit, Phase.generate])
    @given(random_tensors(), st.integers(0, 2**32), st.booleans())
    def run(tensors: tuple[Announced, ...], seed: int, every_chunk: bool) -> None:
        case = PublishCase(NEW, "unique", "random", tensors, "", "fresh", seed, 64, 1, 1, ())
        (plan,) = make_plans(target, case)
        messages = [pb.PublishRequest(start=plan.start)]
        for c in plan.chunks if every_chunk else plan.chunks[:1]:
            chunk = pb.TensorChunk(tensor=c.tensor, offset=c.offset, length=c.length, crc32c=c.crc32c, data=c.payload)
            messages.append(pb.PublishRequest(chunks=[chunk]))
        code, details, responses = outcome(
            lambda: list(target.stub.PublishTensors(iter(messages), timeout=CALL_TIMEOUT_S))
        )
        assert code != grpc.StatusCode.OK, f"answered OK with {len(responses)} responses and no commit"
        assert code.name in PUBLISH_CODES, (code, details)

    run()


def test_tensors_of_any_size_publish_and_load_bit_exact(tmp_path: Path) -> None:
    """Against a `weightstream serve` process: the overflow writes past a buffer, which may corrupt its memory."""
    root = tmp_path / "models"
    (root / GOOD).mkdir(parents=True)
    save_file(state_of(LAYOUT, 1), str(root / GOOD / "model.safetensors"))
    (port,) = free_ports(1)
    address = f"{LOOPBACK}:{port}"
    args = ["--model-root", str(root), "--host", LOOPBACK, "--grpc-port", str(port), "--http-port", "0"]
    with serve_process([*args, "--allow-publish"], tmp_path) as server:
        wait_grpc_ready(server, address, GOOD)

        @settings(CASES, max_examples=5, phases=[Phase.explicit, Phase.generate])
        @given(st.lists(st.integers(1, 200).filter(lambda n: n % 64), min_size=2, max_size=6), st.integers(0, 2**32))
        def run(sizes: list[int], seed: int) -> None:
            layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
                f"t{i}": (torch.uint8, (n,)) for i, n in enumerate(sizes)
            }
            state = state_of(layout, seed)
            with WeightStreamClient(address, progress=False, transport="grpc") as client:
                revision = client.publish(f"odd-{seed}", state, new_layout=True)
                loaded = client.load_state_dict(f"odd-{seed}")
            assert revision
            server.assert_running()
            assert {n: raw_bytes(t) for n, t in loaded.items()} == {n: raw_bytes(t) for n, t in state.items()}

        run()
        server.assert_running()
