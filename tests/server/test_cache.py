"""The shared cache: single-flight reads, hits, the memory bound, freshness, preload and its figures."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.checkpoints import assert_bytes_identical, nbytes, write_model
from tests.support.metrics import samples
from tests.support.servers import eventually, running
from weightstream.client import WeightStreamClient
from weightstream.client.manifest import TensorSlice

MIB = 1024 * 1024


def _load_all(target: str, model: str) -> dict[str, torch.Tensor]:
    with WeightStreamClient(target, progress=False) as client:
        return client.load_state_dict(model)


@pytest.mark.slow
def test_concurrent_cold_loads_read_storage_once(tmp_path: Path) -> None:
    """Four clients start together on a cold cache: storage is read once and all four are bit-identical."""
    state = write_model(tmp_path, "m", tensors=12, numel=2 * MIB)  # 96 MiB in 8 MiB tensors
    with running(tmp_path, cache_bytes=512 * MIB) as r:
        results: list[dict[str, torch.Tensor]] = []
        errors: list[BaseException] = []
        start = threading.Barrier(4)

        def load() -> None:
            try:
                start.wait(timeout=30)
                results.append(_load_all(r.target, "m"))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=load) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert len(results) == 4
        for got in results:
            assert_bytes_identical(state, got)
        status = r.get("/status").json()
        assert status["storage_bytes_read_total"] == nbytes(state)
        assert status["bytes_served_total"] == 4 * nbytes(state)
        cache = status["cache"]
        assert cache["resident_bytes"] >= nbytes(state)
        # Every unit was read by one stream; each of the other three either waited for it or hit it.
        units = cache["units"]
        assert cache["hits"] + cache["shared"] == 3 * units
        metrics = samples(r.get("/metrics").text)
        assert metrics[("weightstream_cache_shared_reads_total", ())] == cache["shared"]
        assert metrics[("weightstream_cache_hits_total", ())] == cache["hits"]


@pytest.mark.slow
def test_second_load_hits_and_resident_bytes_stay_within_capacity(tmp_path: Path) -> None:
    state = write_model(tmp_path, "big", tensors=8, numel=4 * MIB)  # 128 MiB, more than the cache
    with running(tmp_path, cache_bytes=48 * MIB) as r:
        for _ in range(2):
            assert_bytes_identical(state, _load_all(r.target, "big"))
            cache = r.get("/status").json()["cache"]
            assert 0 < cache["resident_bytes"] <= 48 * MIB
        assert cache["evictions"] > 0
        # Each tensor is one 16 MiB read unit; the second load took what the cache still held (at
        # most 3 units of 16 MiB) and read the rest again.
        assert 0 < cache["hits"] <= 3
        assert r.get("/status").json()["storage_bytes_read_total"] == 2 * nbytes(state) - cache["hits"] * 16 * MIB

    small = write_model(tmp_path, "small", tensors=4, numel=MIB)  # 16 MiB, fits
    with running(tmp_path, cache_bytes=48 * MIB) as r:
        for _ in range(3):
            assert_bytes_identical(small, _load_all(r.target, "small"))
        status = r.get("/status").json()
        assert status["storage_bytes_read_total"] == nbytes(small)
        assert status["cache"]["hits"] == 2 * status["cache"]["units"]


def test_changed_file_is_never_served_from_the_cache(tmp_path: Path) -> None:
    """The key holds the file's size and modification time: new bytes of the same size are read afresh."""
    first = write_model(tmp_path, "m", tensors=3, numel=MIB, seed=1)
    with running(tmp_path, cache_bytes=64 * MIB) as r:
        assert_bytes_identical(first, _load_all(r.target, "m"))
        second = {name: torch.randn(t.shape, generator=torch.Generator().manual_seed(2)) for name, t in first.items()}
        path = tmp_path / "m" / "model.safetensors"
        before = path.stat()
        save_file(second, str(path))
        # Same size; make sure the modification time differs even on a coarse clock.
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
        assert path.stat().st_size == before.st_size
        assert_bytes_identical(second, _load_all(r.target, "m"))


def test_slices_of_one_tensor_share_cached_rows(tmp_path: Path) -> None:
    """Ranks of a gathered (dim 1) slice read the same whole-row units: the second rank hits the cache."""
    weight = torch.randn(256, 1024, generator=torch.Generator().manual_seed(3))
    (tmp_path / "w").mkdir()
    save_file({"layers.0.mlp.down_proj.weight": weight}, str(tmp_path / "w" / "model.safetensors"))
    with running(tmp_path, cache_bytes=64 * MIB) as r, WeightStreamClient(r.target, progress=False) as client:
        for rank in range(4):
            piece = TensorSlice(1, rank * 256, (rank + 1) * 256)
            (_, got), *_ = client.iter_tensors("w", slices={"layers.0.mlp.down_proj.weight": piece})
            assert torch.equal(got, weight[:, rank * 256 : (rank + 1) * 256])
        status = r.get("/status").json()
        assert status["storage_bytes_read_total"] == weight.numel() * 4
        assert status["bytes_served_total"] == weight.numel() * 4
        assert status["cache"]["hits"] == 3


def test_preload_warms_the_cache_before_ready(tmp_path: Path) -> None:
    state = write_model(tmp_path, "warm", tensors=4, numel=MIB)
    with running(tmp_path, cache_bytes=64 * MIB, preload=("warm", "no-such-model")) as r:
        # The missing model keeps the server not ready, and says why.
        eventually(
            lambda: "preloading no-such-model failed" in " ".join(r.get("/readyz").json()["reasons"]),
            "the preload failure",
        )
        reasons = r.get("/readyz").json()["reasons"]
        assert r.get("/readyz").status_code == 503
        assert not any("preloading warm" in reason for reason in reasons)
        read_before = r.get("/status").json()["storage_bytes_read_total"]
        assert read_before == nbytes(state)
        assert_bytes_identical(state, _load_all(r.target, "warm"))
        assert r.get("/status").json()["storage_bytes_read_total"] == read_before

    with running(tmp_path, cache_bytes=64 * MIB, preload=("warm",)) as r:
        deadline = time.monotonic() + 30
        while r.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, r.get("/readyz").json()
            time.sleep(0.05)
        assert r.get("/status").json()["cache"]["resident_bytes"] >= nbytes(state)
