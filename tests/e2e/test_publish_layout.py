"""Publishes of tensors of every size and dtype land where their layout places them, and nowhere else.

A `weightstream serve` process under glibc's heap checks (MALLOC_CHECK_=3: a heap corrupted by a
write past a buffer aborts the process at the next allocation) takes publishes of tensors of 1, 2,
100, 200, 4095, 4097 and 16384 bytes of every dtype: in one part and in several, over gRPC and the
data port, whole and as deltas; each revision is loaded back bit-exact, and the server is still up.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from tests.support.commands import clean_env
from tests.support.ports import LOOPBACK, free_ports
from tests.support.serve_processes import ServerProcess, serve_process
from weightstream.client import WeightStreamClient
from weightstream.protocol import dtypes
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.revisions.layout import lay_out
from weightstream_server.revisions.parts import Part

pytestmark = pytest.mark.slow

SIZES = (1, 2, 100, 200, 4095, 4097, 16384)
MODEL = "layouts"


def tensors_of(seed: int) -> dict[str, torch.Tensor]:
    """One tensor of about each size in SIZES of every dtype, random bytes (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for dtype in dtypes.BY_SAFETENSORS.values():
        for size in SIZES:
            count = max(1, size // dtype.itemsize)
            raw = torch.randint(0, 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=generator)
            if dtype.torch is torch.bool:
                raw = raw % 2
            tensors[f"{dtype.safetensors}.{size}"] = raw.view(dtype.torch)
    return tensors


def changed(tensors: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """tensors with every third one's first bytes changed (so that a delta publish sends those)."""
    out = {name: t.clone() for name, t in tensors.items()}
    for index, name in enumerate(sorted(out)):
        if index % 3 == seed % 3:
            flat = out[name].view(torch.uint8)
            flat[: min(8, flat.numel())] ^= 1
    return out


def assert_loads_back(client: WeightStreamClient, revision: str, expected: dict[str, torch.Tensor]) -> None:
    into = {name: torch.empty_like(t) for name, t in expected.items()}
    report = client.load_into(into, MODEL, revision=revision)
    assert report.revision == revision
    for name, tensor in expected.items():
        assert torch.equal(into[name].view(torch.uint8), tensor.view(torch.uint8)), name


def publish_in_parts(
    client: WeightStreamClient, tensors: dict[str, torch.Tensor], revision: str, parts: int, deltas: bool
) -> str:
    """Publish tensors as parts calls at once (each its share of the names); the revision they made."""
    names = sorted(tensors)
    answers: list[str] = []
    errors: list[BaseException] = []

    def send(part: int) -> None:
        try:
            share = {n: tensors[n] for n in names[part::parts]}
            answers.append(
                client.publish(MODEL, share, revision=revision, part=part, parts=parts, new_layout=True, deltas=deltas)
            )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(part,)) for part in range(parts)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert answers == [revision] * parts
    return revision


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    workdir = tmp_path_factory.mktemp("layout")
    (workdir / "models").mkdir()
    grpc_port, data_port = free_ports(2)
    args = [
        "--model-root",
        str(workdir / "models"),
        "--grpc-port",
        str(grpc_port),
        "--data-port",
        str(data_port),
        "--http-port",
        "0",
        "--allow-publish",
        "--keep-revisions",
        "3",
    ]
    with serve_process(args, workdir, env=clean_env(MALLOC_CHECK_="3", MALLOC_PERTURB_="165")) as process:
        process.wait_listening(grpc_port)
        process.wait_listening(data_port)
        yield process, grpc_port
        process.assert_running()


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_every_size_and_dtype_lands_bit_exact_in_one_part_and_several_whole_and_as_deltas(
    server: tuple[ServerProcess, int], transport: str
) -> None:
    process, port = server
    first = tensors_of(1)
    with WeightStreamClient(f"{LOOPBACK}:{port}", progress=False, transport=transport) as client:  # type: ignore[arg-type]
        one = client.publish(MODEL, first, revision=f"one-{transport}", new_layout=True, deltas=True)
        assert_loads_back(client, one, first)
        second = changed(first, 1)
        delta = client.publish(MODEL, second, revision=f"delta-{transport}", new_layout=True, deltas=True)
        assert_loads_back(client, delta, second)

        third = tensors_of(3)
        several = publish_in_parts(client, third, f"parts-{transport}", 3, deltas=True)
        assert_loads_back(client, several, third)
        fourth = changed(third, 2)
        again = publish_in_parts(client, fourth, f"parts-delta-{transport}", 3, deltas=True)
        assert_loads_back(client, again, fourth)
    process.assert_running()
    assert "corrupted" not in process.output()


def test_many_one_byte_tensors_publish_and_load_back(server: tuple[ServerProcess, int]) -> None:
    process, port = server
    tiny = {f"t.{i}": torch.tensor([i % 256], dtype=torch.uint8) for i in range(3000)}
    with WeightStreamClient(f"{LOOPBACK}:{port}", progress=False) as client:
        revision = client.publish(MODEL, tiny, revision="tiny", new_layout=True)
        assert_loads_back(client, revision, tiny)
    process.assert_running()


def test_a_part_buffer_is_as_big_as_its_layout_says() -> None:
    """The layout that places the tensors is the one that sizes the buffer: the last tensor ends inside it."""
    announced = [
        pb.PublishedTensor(name=f"t{i}", dtype=pb.DATA_TYPE_UINT8, shape=[n]) for i, n in enumerate((1, 100, 63, 65, 1))
    ]
    layout = lay_out("m", announced)
    part = Part.allocate(0, layout)
    for tensor in layout.tensors.values():
        assert tensor.offset % 64 == 0
        assert tensor.offset + tensor.nbytes <= part.buffer.numel()
        part.view(tensor).fill_(7)  # every tensor's view lies inside the buffer
