"""Streams that end early, and several streams at once, against one server."""

from __future__ import annotations

import concurrent.futures
import time
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.servers import loopback_settings, serving
from weightstream.client import ResourceExhaustedError, WeightStreamClient
from weightstream.samples import ParameterTree
from weightstream_server import WeightStreamServer

MODEL = "stream-model"


@pytest.fixture(scope="module")
def checkpoint(model_root: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    state = {f"layer.{i}.weight": torch.randn(512, 1024) for i in range(16)}  # 32 MiB
    (model_root / MODEL).mkdir()
    save_file(dict(list(state.items())[:8]), str(model_root / MODEL / "a.safetensors"))
    save_file(dict(list(state.items())[8:]), str(model_root / MODEL / "b.safetensors"))
    return state


def _wait_idle(server: WeightStreamServer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.pool.in_use and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.pool.in_use == 0, "a stream still holds its streamer"


def test_client_that_stops_early_frees_the_stream(
    checkpoint: dict[str, torch.Tensor], server: WeightStreamServer, target: str
) -> None:
    for _ in range(3):
        with WeightStreamClient(target, chunk_bytes=64 * 1024, progress=False) as client:
            for _name, _tensor in client.iter_tensors(MODEL):
                break
        _wait_idle(server)
    with WeightStreamClient(target, progress=False) as client:
        got = client.load_state_dict(MODEL)
    assert all(torch.equal(got[n], t) for n, t in checkpoint.items())


def test_concurrent_loads_are_each_complete(checkpoint: dict[str, torch.Tensor], target: str) -> None:
    def load() -> dict[str, torch.Tensor]:
        with WeightStreamClient(target, chunk_bytes=256 * 1024, progress=False) as client:
            return client.load_state_dict(MODEL)

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda _: load(), range(4)))
    for got in results:
        assert set(got) == set(checkpoint)
        assert all(torch.equal(got[n], t) for n, t in checkpoint.items())


def test_streams_beyond_the_limit_are_resource_exhausted(checkpoint: dict[str, torch.Tensor], model_root: Path) -> None:
    with serving(loopback_settings(model_root=model_root, max_streams=1)) as server:
        target = f"127.0.0.1:{server.port}"
        with WeightStreamClient(target, chunk_bytes=16 * 1024, progress=False) as first:
            stream = first.iter_tensors(MODEL)
            next(stream)  # the only stream slot is now held
            with WeightStreamClient(target, progress=False, retry=None) as second:
                with pytest.raises(ResourceExhaustedError, match="1 streams are already running"):
                    second.load_state_dict(MODEL)
            rest = dict(stream)
        assert len(rest) == len(checkpoint) - 1


@pytest.mark.parametrize("streams", [2, 3, 20])
def test_parallel_streams_load_every_byte(
    checkpoint: dict[str, torch.Tensor], target: str, server: WeightStreamServer, streams: int
) -> None:
    module = ParameterTree({n: (tuple(t.shape), t.dtype) for n, t in checkpoint.items()})
    with WeightStreamClient(target, chunk_bytes=128 * 1024, progress=False, streams=streams) as client:
        report = client.load_into(module, MODEL)
        streamed = dict(client.iter_tensors(MODEL))
    assert report.tensors == len(checkpoint)
    for name, param in module.named_parameters():
        assert torch.equal(param, checkpoint[name]), name
        assert torch.equal(streamed[name], checkpoint[name]), name
    _wait_idle(server)


def test_parallel_streams_relay_the_first_error_and_stop_the_others(
    checkpoint: dict[str, torch.Tensor], model_root: Path
) -> None:
    """With room for only one stream on the server, the second stream's refusal ends the whole load."""
    with serving(loopback_settings(model_root=model_root, max_streams=1)) as server:
        module = ParameterTree({n: (tuple(t.shape), t.dtype) for n, t in checkpoint.items()})
        with WeightStreamClient(
            f"127.0.0.1:{server.port}", chunk_bytes=16 * 1024, progress=False, streams=4, retry=None
        ) as c:
            with pytest.raises(ResourceExhaustedError) as info:
                c.load_into(module, MODEL)
        assert info.value.partially_written is not None
        _wait_idle(server)


@pytest.mark.parametrize("streams", [1, 2])
def test_iter_tensors_keeps_no_tensor_it_has_yielded(
    checkpoint: dict[str, torch.Tensor], target: str, streams: int
) -> None:
    """Memory held is bounded by the tensors in flight: every tensor yielded and dropped is freed."""
    refs: list[weakref.ref[torch.Tensor]] = []
    with WeightStreamClient(target, chunk_bytes=256 * 1024, progress=False, streams=streams) as client:
        for name, tensor in client.iter_tensors(MODEL):
            assert torch.equal(tensor, checkpoint[name])
            refs.append(weakref.ref(tensor))
            del tensor  # tensors hold no reference cycles: refcounting frees them at once
            # Each stream may still hold the tensor it completed last, until it is asked for the next.
            alive = sum(ref() is not None for ref in refs)
            assert alive <= streams, f"{alive} tensors already yielded are still referenced"
    assert len(refs) == len(checkpoint)
