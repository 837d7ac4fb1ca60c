"""A full load teaches the server the storage revision it read: the block CRC32Cs of its tensors are
recorded from the chunks' checksums as they stream, so that an update since it, once its files were
rewritten, moves about the changed bytes, with no watch, no GetChanges before the rewrite and no
second read of the old files. Real files rewritten on disk, a real server on loopback, every
transport's way of reading (the streamer, the data port's reads from the page cache, the RAM cache)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.e2e.test_revisions import assert_holds, module_of
from tests.support.ports import free_ports
from tests.support.servers import loopback_settings, serving
from weightstream.client import WeightStreamClient
from weightstream_server import WeightStreamServer

MODEL = "learned"
# Eight float32 tensors of 4 MiB in one file.
SHAPES = {f"layers.{i}.weight": (1024, 1024) for i in range(8)}
REWRITTEN = ["layers.2.weight", "layers.5.weight"]
MIB = 1024 * 1024


def state_of(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name, shape in SHAPES.items()}


def rewritten(state: dict[str, torch.Tensor], names: list[str], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=generator) if name in names else t for name, t in state.items()}


def nbytes(state: dict[str, torch.Tensor], names: list[str]) -> int:
    return sum(state[n].numel() * state[n].element_size() for n in names)


def write(path: Path, state: dict[str, torch.Tensor]) -> None:
    """state saved to path the way most tools write a checkpoint: a new file renamed over the name."""
    staged = path.with_name(path.name + ".incoming")
    save_file(state, str(staged))
    staged.replace(path)


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="weightstream-test-learned-", dir="/dev/shm") as name:
        yield Path(name)


def served(server: WeightStreamServer) -> int:
    return server.stats.snapshot().bytes_served_total


def digested(server: WeightStreamServer) -> int:
    assert server.changes is not None
    return server.changes.bytes_digested


# (transport, RAM cache bytes): the streamer's reads (gRPC), the data port's reads of the page cache
# (tcp), reads into the shared-memory slots (shm), and reads through the RAM cache.
WAYS = [("grpc", 0), ("tcp", 0), ("shm", 0), ("grpc", 64 * MIB)]


@pytest.mark.parametrize(("transport", "cache_bytes"), WAYS)
def test_an_update_since_a_loaded_storage_revision_moves_about_the_changed_bytes(
    tmp_path: Path, shm_dir: Path, transport: str, cache_bytes: int
) -> None:
    a = state_of(0)
    b = rewritten(a, REWRITTEN, seed=1)
    (tmp_path / MODEL).mkdir()
    path = tmp_path / MODEL / "model.safetensors"
    write(path, a)
    settings = loopback_settings(
        model_root=tmp_path, cache_bytes=cache_bytes, shm_dir=shm_dir, data_port=free_ports(1)[0]
    )
    options: dict[str, object] = {"shm_dir": shm_dir} if transport == "shm" else {}
    with (
        serving(settings) as server,
        WeightStreamClient(f"127.0.0.1:{server.port}", progress=False, transport=transport, **options) as client,  # type: ignore[arg-type]
    ):
        module = module_of(a)
        since = client.load_into(module, MODEL).revision
        assert digested(server) == 0  # nobody asked for changes or watched: A was only streamed
        write(path, b)
        before = served(server)
        report = client.update_into(module, MODEL, since=since)
        sent = served(server) - before
        assert_holds(module, b)
        assert report.revision != since
        # The new revision's files are read to be compared; A's, gone, are not read again.
        assert digested(server) == nbytes(b, list(SHAPES))
    changed = nbytes(b, REWRITTEN)
    assert sent <= 1.1 * changed, (sent, changed)
