"""Files that are not what their names say: FIFOs, symlink loops, names longer than the file system allows.

Each must end its call promptly with a client's status code (DATA_LOSS for a model that holds
something other than a regular file under a checkpoint's name, NOT_FOUND for a path that leads
nowhere, INVALID_ARGUMENT for an id no file system can hold), logged as one line with no traceback,
and the server must go on serving other models. A FIFO is the sharpest case: opening one for
reading waits for a writer, so a server that opened it would wedge a worker for good.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.checkpoints import pattern_tensors, received, write_pattern_file
from tests.support.ports import LOOPBACK, free_ports
from tests.support.serve_processes import serve_process, wait_grpc_ready
from tests.support.servers import loopback_settings, serving
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

GOOD = "special-good"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# A call that would wait on a FIFO is cut off here; a prompt answer comes in well under it.
CALL_TIMEOUT_S = 10.0
PROMPT_S = 5.0


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("special-root")
    write_pattern_file(root / GOOD / WEIGHTS, b"good", 4096, tensors=2)
    yield root
    release_fifos(root)


def release_fifos(root: Path) -> None:
    """Open every FIFO under root for writing and close it, so that a reader stuck in open() sees end of file."""
    for path in root.rglob("*"):
        if path.is_fifo():
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture(scope="module")
def stub(root: Path) -> Iterator[pb_grpc.WeightStreamServiceStub]:
    with (
        serving(loopback_settings(model_root=root)) as server,
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
    ):
        try:
            yield pb_grpc.WeightStreamServiceStub(channel)
        finally:
            release_fifos(root)  # a server that is stuck in one cannot stop otherwise


@pytest.fixture
def still_serving(stub: pb_grpc.WeightStreamServiceStub, root: Path) -> Iterator[None]:
    yield
    request = pb.StreamTensorsRequest(model=GOOD)
    assert received(stub.StreamTensors(request, timeout=CALL_TIMEOUT_S)) == (
        grpc.StatusCode.OK,
        pattern_tensors(root / GOOD / WEIGHTS),
    )


def call_error(call: Callable[[], object]) -> grpc.RpcError:
    """The error call ends with (its response stream read to the end), which must come promptly."""
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if isinstance(result, Iterator):
            for _ in result:
                pass
    elapsed = time.monotonic() - started
    assert elapsed < PROMPT_S, f"the answer took {elapsed:.1f} s: {info.value.code()} {info.value.details()}"
    return info.value


def every_rpc(stub: pb_grpc.WeightStreamServiceStub, model: str, file: str) -> dict[str, Callable[[], object]]:
    return {
        "GetManifest": lambda: stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S),
        "ListModelFiles": lambda: stub.ListModelFiles(pb.ListModelFilesRequest(model=model), timeout=CALL_TIMEOUT_S),
        "ReadModelFile": lambda: stub.ReadModelFile(
            pb.ReadModelFileRequest(model=model, file=file), timeout=CALL_TIMEOUT_S
        ),
    }


def assert_one_line_each(caplog: pytest.LogCaptureFixture, count: int) -> None:
    """The server logged each failed call as one line: no traceback, no "internal error"."""
    lines = [r for r in caplog.records if r.name == "weightstream_server.transports.rpc"]
    assert len(lines) == count, [r.getMessage() for r in lines]
    assert not [r for r in lines if r.exc_info], "a failed call was logged with a traceback"
    assert "Traceback" not in caplog.text
    assert "internal error" not in caplog.text


# --- FIFOs ------------------------------------------------------------------------------------------

# (where the FIFO is, the file the ReadModelFile call asks for, the RPCs that must fail DATA_LOSS)
FIFOS = {
    "index": (INDEX, WEIGHTS, ("GetManifest", "ListModelFiles", "ReadModelFile")),
    "weights": ("x.safetensors", "x.safetensors", ("GetManifest", "ListModelFiles", "ReadModelFile")),
    "companion": ("config.json", "config.json", ("ListModelFiles", "ReadModelFile")),
}


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize("where", sorted(FIFOS))
def test_a_fifo_in_a_model_is_data_loss_at_once(
    stub: pb_grpc.WeightStreamServiceStub, root: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="weightstream_server")
    name, asked, failing = FIFOS[where]
    model = f"fifo-{where}"
    write_pattern_file(root / model / WEIGHTS, b"fifo", 4096)
    os.mkfifo(root / model / name)
    calls = every_rpc(stub, model, asked)
    for rpc in failing:
        error = call_error(calls[rpc])
        details = error.details() or ""
        assert error.code() == grpc.StatusCode.DATA_LOSS, (rpc, details)
        assert f"model '{model}'" in details and name in details, (rpc, details)
        assert "not a regular file" in details, (rpc, details)
    assert_one_line_each(caplog, len(failing))


@pytest.mark.slow
def test_a_fifo_index_leaves_the_server_serving_and_stoppable(tmp_path: Path) -> None:
    """A `weightstream serve` process: requests for a model whose index is a FIFO, many at once, then a
    good model, then one SIGTERM, which must end the process."""
    root = tmp_path / "models"
    write_pattern_file(root / GOOD / WEIGHTS, b"good", 4096, tensors=2)
    write_pattern_file(root / "fifo-index" / WEIGHTS, b"fifo", 4096)
    os.mkfifo(root / "fifo-index" / INDEX)
    (port,) = free_ports(1)
    target = f"{LOOPBACK}:{port}"
    args = ["--model-root", str(root), "--host", LOOPBACK, "--grpc-port", str(port), "--http-port", "0"]
    try:
        with serve_process(args, tmp_path) as server, grpc.insecure_channel(target) as channel:
            wait_grpc_ready(server, target, GOOD)
            stub = pb_grpc.WeightStreamServiceStub(channel)
            request = pb.GetManifestRequest(model="fifo-index")
            futures = [stub.GetManifest.future(request, timeout=CALL_TIMEOUT_S) for _ in range(32)]
            codes = {f.exception().code() if f.exception() else grpc.StatusCode.OK for f in futures}
            assert codes == {grpc.StatusCode.DATA_LOSS}
            manifest = stub.GetManifest(pb.GetManifestRequest(model=GOOD), timeout=CALL_TIMEOUT_S)
            assert len(manifest.tensors) == 2
            assert server.terminate_and_wait() == 0
    finally:
        release_fifos(root)


# --- names and links that lead nowhere --------------------------------------------------------------


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize("length", [256, 300, 511])
def test_a_model_id_with_a_component_too_long_for_the_file_system_is_invalid_argument(
    stub: pb_grpc.WeightStreamServiceStub, length: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="weightstream_server")
    model = "n" * length
    for rpc, call in every_rpc(stub, model, WEIGHTS).items():
        error = call_error(call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (rpc, error.details())
    stream = pb.StreamTensorsRequest(model=model)
    assert call_error(lambda: stub.StreamTensors(stream, timeout=CALL_TIMEOUT_S)).code() == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert_one_line_each(caplog, 4)


# (what loops, the RPCs that must end NOT_FOUND)
LOOPS = {
    "folder": ("GetManifest", "ListModelFiles", "ReadModelFile"),
    "weights": ("GetManifest", "ListModelFiles", "ReadModelFile"),
    "companion": ("ListModelFiles", "ReadModelFile"),
}


@pytest.mark.usefixtures("still_serving")
@pytest.mark.parametrize("what", sorted(LOOPS))
def test_a_symlink_loop_is_not_found(
    stub: pb_grpc.WeightStreamServiceStub, root: Path, what: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="weightstream_server")
    model = f"loop-{what}"
    asked = WEIGHTS
    if what == "folder":
        (root / model).symlink_to(f"{model}-other", target_is_directory=True)
        (root / f"{model}-other").symlink_to(model, target_is_directory=True)
    else:
        folder = root / model
        write_pattern_file(folder / WEIGHTS, b"loop", 4096)
        name = "x.safetensors" if what == "weights" else "config.json"
        (folder / name).symlink_to("other")
        (folder / "other").symlink_to(name)
        asked = name
    calls = every_rpc(stub, model, asked)
    for rpc in LOOPS[what]:
        error = call_error(calls[rpc])
        details = error.details() or ""
        assert error.code() == grpc.StatusCode.NOT_FOUND, (rpc, details)
        assert f"model '{model}'" in details, (rpc, details)
    assert_one_line_each(caplog, len(LOOPS[what]))
