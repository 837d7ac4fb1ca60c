"""Bad input: each case gets its exact exception and status code, and the server keeps serving."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from tests.support.checkpoints import write_raw_safetensors
from weightstream.client import (
    FailedPreconditionError,
    IncompatibleModuleError,
    IntegrityError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    WeightStreamClient,
)
from weightstream.samples import ParameterTree
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

GOOD = "good-model"


@pytest.fixture(scope="module")
def good(model_root: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    state = {"a.weight": torch.randn(300, 200), "a.bias": torch.randn(200), "b.weight": torch.randn(64, 64).half()}
    (model_root / GOOD).mkdir()
    save_file(state, str(model_root / GOOD / "model.safetensors"))
    return state


@pytest.fixture
def still_serving(good: dict[str, torch.Tensor], client: WeightStreamClient):  # type: ignore[no-untyped-def]
    """After the test body, the same server must still load a good model correctly."""
    yield
    module = ParameterTree({n: (tuple(t.shape), t.dtype) for n, t in good.items()})
    report = client.load_into(module, GOOD)
    assert report.tensors == len(good)
    for name, param in module.named_parameters():
        assert torch.equal(param, good[name]), name


def _stub(target: str) -> pb_grpc.WeightStreamServiceStub:
    return pb_grpc.WeightStreamServiceStub(grpc.insecure_channel(target))


@pytest.mark.usefixtures("still_serving")
def test_unknown_model_is_not_found(client: WeightStreamClient) -> None:
    with pytest.raises(NotFoundError, match="no-such-model") as info:
        client.manifest("no-such-model")
    assert info.value.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize("model", ["../good-model", "/etc", "good-model/../../x", "a/./b", "", "a\x00b", ".hidden"])
def test_ids_that_could_escape_are_invalid(client: WeightStreamClient, model: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        client.manifest(model)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def _fifo(path: Path) -> Path:
    """A FIFO: opening it for reading blocks, so a server that tried to read it would hang."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


@pytest.mark.usefixtures("still_serving")
def test_symlinked_folder_outside_root_is_refused_unread(model_root: Path, tmp_path: Path, target: str) -> None:
    _fifo(tmp_path / "outside" / "model.safetensors")
    (model_root / "escape-dir").symlink_to(tmp_path / "outside", target_is_directory=True)
    with WeightStreamClient(target, timeout=10, progress=False) as client:
        with pytest.raises(PermissionDeniedError, match="outside the model root") as info:
            client.manifest("escape-dir")
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.usefixtures("still_serving")
def test_symlinked_file_outside_root_is_refused_unread(model_root: Path, tmp_path: Path, target: str) -> None:
    folder = model_root / "escape-file"
    folder.mkdir()
    (folder / "model.safetensors").symlink_to(_fifo(tmp_path / "secret.safetensors"))
    with WeightStreamClient(target, timeout=10, progress=False) as client:
        with pytest.raises(PermissionDeniedError, match=r"model\.safetensors"):
            client.manifest("escape-file")


@pytest.mark.usefixtures("still_serving")
def test_symlink_inside_root_is_followed(
    model_root: Path, good: dict[str, torch.Tensor], client: WeightStreamClient
) -> None:
    (model_root / "alias-model").symlink_to(model_root / GOOD, target_is_directory=True)
    assert {t.name for t in client.manifest("alias-model").tensors} == set(good)


@pytest.mark.usefixtures("still_serving")
def test_truncated_file_is_data_loss_naming_the_file(model_root: Path, client: WeightStreamClient) -> None:
    path = model_root / "truncated" / "model-00001.safetensors"
    path.parent.mkdir()
    save_file({"x": torch.randn(1000), "y": torch.randn(1000)}, str(path))
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(IntegrityError, match=r"model-00001\.safetensors") as info:
        client.manifest("truncated")
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert "truncated" in str(info.value)


@pytest.mark.usefixtures("still_serving")
def test_overlapping_offsets_are_data_loss(model_root: Path, client: WeightStreamClient) -> None:
    header = {
        "x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "y": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    write_raw_safetensors(model_root / "overlap" / "bad.safetensors", header, bytes(24))
    with pytest.raises(IntegrityError, match=r"bad\.safetensors.*overlap") as info:
        client.load_state_dict("overlap")
    assert info.value.code == grpc.StatusCode.DATA_LOSS


@pytest.mark.usefixtures("still_serving")
def test_offsets_past_the_end_are_data_loss(model_root: Path, client: WeightStreamClient) -> None:
    header = {"x": {"dtype": "F32", "shape": [100], "data_offsets": [0, 400]}}
    write_raw_safetensors(model_root / "past-end" / "short.safetensors", header, bytes(40))
    with pytest.raises(IntegrityError, match=r"short\.safetensors.*'x' ends at byte 400"):
        client.manifest("past-end")


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, "needs 12"),
        ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "invalid shape"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}}, "invalid data_offsets"),
        ({"x": {"shape": [1], "data_offsets": [0, 4]}}, "missing dtype"),
        ({"x": [1, 2]}, "not a JSON object"),
        ({"x": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}, "needs"),
    ],
)
def test_malformed_headers_are_data_loss(
    model_root: Path, client: WeightStreamClient, header: dict[str, object], message: str
) -> None:
    name = f"malformed-{abs(hash(str(header))) % 10**8}"
    write_raw_safetensors(model_root / name / "m.safetensors", header, bytes(16))
    with pytest.raises(IntegrityError, match=message):
        client.manifest(name)


@pytest.mark.usefixtures("still_serving")
def test_huge_header_length_is_refused_before_reading(model_root: Path, client: WeightStreamClient) -> None:
    path = model_root / "huge-header" / "h.safetensors"
    path.parent.mkdir()
    path.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(IntegrityError, match="header length"):
        client.manifest("huge-header")


@pytest.mark.usefixtures("still_serving")
def test_unsupported_dtype_is_failed_precondition(model_root: Path, client: WeightStreamClient) -> None:
    header = {"x": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}
    write_raw_safetensors(model_root / "complex" / "c.safetensors", header, bytes(8))
    with pytest.raises(FailedPreconditionError, match="unsupported dtype 'C64'"):
        client.manifest("complex")


@pytest.mark.usefixtures("still_serving")
def test_index_naming_a_missing_tensor_is_data_loss(model_root: Path, client: WeightStreamClient) -> None:
    folder = model_root / "bad-index"
    folder.mkdir()
    save_file({"x": torch.ones(2)}, str(folder / "a.safetensors"))
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"x": "a.safetensors", "z": "a.safetensors"}}')
    with pytest.raises(IntegrityError, match="'z'"):
        client.manifest("bad-index")


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_shape_or_dtype_mismatch_names_tensor_and_leaves_module_untouched(
    good: dict[str, torch.Tensor], client: WeightStreamClient, change: str
) -> None:
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in good.items()}
    if change == "shape":
        shapes["a.bias"] = ((201,), torch.float32)
    else:
        shapes["a.bias"] = ((200,), torch.float64)
    module = ParameterTree(shapes)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(7)
    with pytest.raises(IncompatibleModuleError, match=r"'a\.bias'") as info:
        client.load_into(module, GOOD)
    assert info.value.partially_written is False
    assert "not written" in str(info.value)
    assert all(bool((p == 7).all()) for p in module.parameters())


@pytest.mark.usefixtures("still_serving")
def test_strict_reports_missing_and_unexpected_then_non_strict_loads_the_rest(
    good: dict[str, torch.Tensor], client: WeightStreamClient
) -> None:
    shapes = {n: (tuple(t.shape), t.dtype) for n, t in good.items() if n != "b.weight"}
    shapes["extra.weight"] = ((3,), torch.float32)
    module = ParameterTree(shapes)
    with pytest.raises(IncompatibleModuleError, match=r"1 missing, 1 unexpected") as info:
        client.load_into(module, GOOD)
    assert "'extra.weight'" in str(info.value) and "'b.weight'" in str(info.value)
    assert info.value.partially_written is False

    report = client.load_into(module, GOOD, strict=False)
    assert report.missing == ["extra.weight"] and report.unexpected == ["b.weight"]
    assert report.tensors == 2
    assert torch.equal(module.get_parameter("a.weight"), good["a.weight"])


@pytest.mark.usefixtures("still_serving")
def test_unknown_tensor_name(good: dict[str, torch.Tensor], client: WeightStreamClient, target: str) -> None:
    with pytest.raises(NotFoundError, match="'nope'"):
        list(client.iter_tensors(GOOD, names=["a.bias", "nope"]))
    request = pb.StreamTensorsRequest(model=GOOD, tensors=[pb.TensorRequest(name="nope")])
    with pytest.raises(grpc.RpcError) as info:
        list(_stub(target).StreamTensors(request))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope'" in info.value.details()


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize(
    ("tensor", "max_chunk_bytes", "code"),
    [
        (pb.TensorRequest(name="a.bias", ranges=[pb.ByteRange(start=0, end=801)]), 0, grpc.StatusCode.OUT_OF_RANGE),
        (pb.TensorRequest(name="a.bias", ranges=[pb.ByteRange(start=5, end=5)]), 0, grpc.StatusCode.OUT_OF_RANGE),
        (
            pb.TensorRequest(name="a.bias", ranges=[pb.ByteRange(start=0, end=10), pb.ByteRange(start=5, end=20)]),
            0,
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (pb.TensorRequest(name="a.bias"), 10, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_bad_stream_requests(
    good: dict[str, torch.Tensor],
    target: str,
    tensor: pb.TensorRequest,
    max_chunk_bytes: int,
    code: grpc.StatusCode,
) -> None:
    request = pb.StreamTensorsRequest(model=GOOD, tensors=[tensor], max_chunk_bytes=max_chunk_bytes)
    with pytest.raises(grpc.RpcError) as info:
        list(_stub(target).StreamTensors(request))
    assert info.value.code() == code
    assert info.value.details()


@pytest.mark.usefixtures("still_serving")
def test_changed_revision_is_failed_precondition(good: dict[str, torch.Tensor], target: str) -> None:
    request = pb.StreamTensorsRequest(model=GOOD, revision="not-the-revision")
    with pytest.raises(grpc.RpcError) as info:
        list(_stub(target).StreamTensors(request))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "changed" in info.value.details()


def test_byte_ranges_send_exactly_those_bytes(good: dict[str, torch.Tensor], target: str) -> None:
    """The resume points of the contract: only the asked-for ranges come back, at their offsets."""
    expected = good["a.weight"].reshape(-1).view(torch.uint8).numpy().tobytes()
    ranges = [(10, 100), (5000, 70000), (239000, 240000)]
    request = pb.StreamTensorsRequest(
        model=GOOD,
        tensors=[pb.TensorRequest(name="a.weight", ranges=[pb.ByteRange(start=s, end=e) for s, e in ranges])],
        max_chunk_bytes=16384,
    )
    pieces = []
    for response in _stub(target).StreamTensors(request):
        for chunk in response.chunks:
            assert chunk.tensor == "a.weight"
            assert chunk.data == expected[chunk.offset : chunk.offset + len(chunk.data)]
            assert len(chunk.data) <= 16384
            pieces.append((chunk.offset, chunk.offset + len(chunk.data)))
    pieces.sort()
    covered = sum(e - s for s, e in pieces)
    assert covered == sum(e - s for s, e in ranges)
    assert pieces[0][0] == 10 and pieces[-1][1] == 240000
