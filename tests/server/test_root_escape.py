"""Reads outside the model root: a file or a model folder swapped for a symlink to outside after the server listed it.

Anyone who can write inside a model root must not be able to read, through the server, what the
server's user can read elsewhere. Whatever the moment of the swap, no byte of the outside ("secret")
file may reach the client: the call fails with PERMISSION_DENIED when the server meets the escaping
link (at any open, not only when it lists the model), FAILED_PRECONDITION when the file it holds
open is no longer the one it listed, or it serves the bytes of the file it listed, bit for bit.

The swaps "after the listing, before the open" happen at that exact moment: LocalSource.resolve of
the in-process server is wrapped to swap right after it returns, a race no test could win reliably
otherwise. The swaps mid-stream are real: a client that reads slowly holds the stream in flight.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from tests.support.checkpoints import pattern_tensors, received, write_pattern_file
from tests.support.servers import loopback_settings
from weightstream.client import PermissionDeniedError, WeightStreamClient
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc
from weightstream_server import ServerSettings
from weightstream_server.storage.local import LocalSource
from weightstream_server.storage.sources import ModelFiles

MIB = 1024 * 1024
PUBLIC = b"public-bytes-"
SECRET = b"SECRET-BYTES-"
MARKER = b"SECRET"
# Large against the smallest read-ahead (16 MiB): the stream is far from done when the first message arrives.
STREAM_BYTES = 96 * MIB
SMALL_BYTES = MIB
CALL_TIMEOUT_S = 60.0
WEIGHTS = "model.safetensors"
ESCAPED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION)


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder outside the model root that the server's user can read: where the secrets are."""
    return tmp_path_factory.mktemp("escape-outside")


@pytest.fixture(scope="module")
def root_settings(root: Path) -> ServerSettings:
    # The smallest read-ahead, so that a stream reads its file over many seconds' worth of messages.
    return loopback_settings(model_root=root, read_ahead_bytes=16 * MIB)


@pytest.fixture(scope="module")
def target(stub_target: str) -> str:
    return stub_target


Arm = Callable[[Callable[[], None], int], None]


@pytest.fixture
def after_listing(monkeypatch: pytest.MonkeyPatch) -> Arm:
    """arm(action, calls): run action right after the calls-th LocalSource.resolve from now returns.

    The server runs in this process, so this is the moment between the server's check of the paths
    and its first read of the files.
    """
    armed: list[tuple[list[int], Callable[[], None]]] = []
    lock = threading.Lock()
    original = LocalSource.resolve

    def resolve(self: LocalSource, model: str) -> ModelFiles:
        located = original(self, model)
        with lock:
            for countdown, _ in armed:
                countdown[0] -= 1
            due = [action for countdown, action in armed if countdown[0] == 0]
            armed[:] = [entry for entry in armed if entry[0][0] > 0]
        for action in due:
            action()
        return located

    monkeypatch.setattr(LocalSource, "resolve", resolve)

    def arm(action: Callable[[], None], calls: int = 1) -> None:
        with lock:
            armed.append(([calls], action))

    return arm


def public_model(root: Path, name: str, nbytes: int) -> Path:
    folder = root / name
    write_pattern_file(folder / WEIGHTS, PUBLIC, nbytes, tensors=4, prefix="public")
    return folder


def secret_folder(outside: Path, name: str, nbytes: int) -> Path:
    """A model folder outside the root laid out like public_model's (same header length and offsets)."""
    folder = outside / name
    write_pattern_file(folder / WEIGHTS, SECRET, nbytes, tensors=4, prefix="secret")
    return folder


def replace_with_link(path: Path, target: Path) -> None:
    """Put a symlink to target where path is, in one rename (a folder is moved aside first, inside the root)."""
    link = path.with_name(f".{path.name}.link")
    link.symlink_to(target, target_is_directory=target.is_dir())
    if path.is_dir() and not path.is_symlink():
        path.rename(path.with_name(f".{path.name}.aside"))
    os.replace(link, path)


def swap(what: str, folder: Path, secret: Path) -> Callable[[], None]:
    if what == "file":
        return lambda: replace_with_link(folder / WEIGHTS, secret / WEIGHTS)
    return lambda: replace_with_link(folder, secret)


def assert_no_secret(payload: dict[str, bytes]) -> None:
    assert not any(MARKER in data for data in payload.values()), "bytes of a file outside the model root were sent"
    assert not any(name.startswith("secret") for name in payload), "a tensor of a file outside the model root was sent"


def stream_request(model: str, revision: str = "") -> pb.StreamTensorsRequest:
    return pb.StreamTensorsRequest(model=model, max_chunk_bytes=MIB, revision=revision)


def read_request(model: str, chunk: int = 64 * 1024) -> pb.ReadModelFileRequest:
    return pb.ReadModelFileRequest(model=model, file=WEIGHTS, max_chunk_bytes=chunk)


# --- swapped after the listing, before the first read ---------------------------------------------


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_manifest_never_reads_a_header_through_a_link_swapped_in_after_listing(
    stub: pb_grpc.WeightStreamServiceStub, root: Path, outside: Path, after_listing: Arm, what: str
) -> None:
    model = f"manifest-{what}"
    folder = public_model(root, model, SMALL_BYTES)
    secret = secret_folder(outside, model, SMALL_BYTES)
    after_listing(swap(what, folder, secret), 1)
    with pytest.raises(grpc.RpcError) as info:
        stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
    details = info.value.details() or ""
    assert "outside the model root" in details
    assert "secret" not in details


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_stream_never_reads_through_a_link_swapped_in_after_listing(
    stub: pb_grpc.WeightStreamServiceStub, root: Path, outside: Path, after_listing: Arm, what: str
) -> None:
    model = f"stream-{what}"
    folder = public_model(root, model, SMALL_BYTES)
    secret = secret_folder(outside, model, SMALL_BYTES)
    revision = stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S).revision
    after_listing(swap(what, folder, secret), 1)
    code, payload = received(stub.StreamTensors(stream_request(model, revision), timeout=CALL_TIMEOUT_S))
    assert_no_secret(payload)
    assert code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_file_read_never_reads_through_a_link_swapped_in_after_listing(
    stub: pb_grpc.WeightStreamServiceStub, root: Path, outside: Path, after_listing: Arm, what: str
) -> None:
    model = f"read-{what}"
    folder = public_model(root, model, SMALL_BYTES)
    secret = secret_folder(outside, model, SMALL_BYTES)
    after_listing(swap(what, folder, secret), 1)
    code, payload = received(stub.ReadModelFile(read_request(model), timeout=CALL_TIMEOUT_S))
    assert_no_secret(payload)
    assert code == grpc.StatusCode.PERMISSION_DENIED


def test_load_and_fetch_refuse_a_link_swapped_in_after_listing(
    target: str, root: Path, outside: Path, after_listing: Arm, tmp_path: Path
) -> None:
    """The client's load_state_dict (GetManifest, then StreamTensors) and fetch (ListModelFiles, then ReadModelFile)."""
    for model, call in (
        ("client-load", lambda c, m: c.load_state_dict(m)),
        ("client-fetch", lambda c, m: c.fetch(m, tmp_path / m)),
    ):
        folder = public_model(root, model, SMALL_BYTES)
        secret = secret_folder(outside, model, SMALL_BYTES)
        after_listing(swap("file", folder, secret), 2)  # after the manifest or listing, before the read
        with WeightStreamClient(target, progress=False, timeout=CALL_TIMEOUT_S) as client:
            with pytest.raises(PermissionDeniedError, match="outside the model root"):
                call(client, model)
        written = {str(p): p.read_bytes() for p in (tmp_path / model).rglob("*") if p.is_file()}
        assert_no_secret(written)


# --- swapped mid-stream -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("rpc", ["StreamTensors", "ReadModelFile"])
@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_swap_mid_stream_never_sends_outside_bytes(
    stub: pb_grpc.WeightStreamServiceStub, root: Path, outside: Path, rpc: str, what: str
) -> None:
    """Either the stream fails (PERMISSION_DENIED or FAILED_PRECONDITION) or it sends the listed file, bit for bit."""
    model = f"mid-{rpc.lower()}-{what}"
    folder = public_model(root, model, STREAM_BYTES)
    secret = secret_folder(outside, model, STREAM_BYTES)
    if rpc == "StreamTensors":
        responses = stub.StreamTensors(stream_request(model), timeout=CALL_TIMEOUT_S)
        expected = pattern_tensors(folder / WEIGHTS)
    else:
        responses = stub.ReadModelFile(read_request(model), timeout=CALL_TIMEOUT_S)
        expected = {"": (folder / WEIGHTS).read_bytes()}
    code, payload = received(responses, between=swap(what, folder, secret))
    assert_no_secret(payload)
    if code != grpc.StatusCode.OK:
        assert code in ESCAPED
    else:
        assert payload == expected, "the stream ended OK with other bytes than those of the file it listed"


# --- links that stay inside the root ----------------------------------------------------------------


def test_links_that_stay_inside_the_root_are_followed(stub: pb_grpc.WeightStreamServiceStub, root: Path) -> None:
    """A relative file link through "..", an absolute one, and a chain of folder links, all inside the root."""
    real = public_model(root, "inside-real", SMALL_BYTES)
    (real / "config.json").write_text("{}")
    linked = root / "inside-linked"
    linked.mkdir()
    (linked / WEIGHTS).symlink_to(Path("..") / "inside-real" / WEIGHTS)
    (linked / "config.json").symlink_to(real / "config.json")
    (root / "inside-alias-1").symlink_to("inside-real", target_is_directory=True)
    (root / "inside-alias-2").symlink_to(root / "inside-alias-1", target_is_directory=True)
    tensors = pattern_tensors(real / WEIGHTS)
    whole = {"": (real / WEIGHTS).read_bytes()}
    for model in ("inside-linked", "inside-alias-2"):
        manifest = stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S)
        assert [t.name for t in manifest.tensors] == sorted(tensors)
        streamed = received(stub.StreamTensors(stream_request(model), timeout=CALL_TIMEOUT_S))
        assert streamed == (grpc.StatusCode.OK, tensors)
        read = received(stub.ReadModelFile(read_request(model), timeout=CALL_TIMEOUT_S))
        assert read == (grpc.StatusCode.OK, whole)
    config = pb.ReadModelFileRequest(model="inside-linked", file="config.json")
    assert received(stub.ReadModelFile(config, timeout=CALL_TIMEOUT_S)) == (grpc.StatusCode.OK, {"": b"{}"})


def test_link_chains_that_leave_the_root_are_refused(
    stub: pb_grpc.WeightStreamServiceStub, root: Path, outside: Path
) -> None:
    """Through a link inside the root to one that leaves it, and by enough ".." to climb out."""
    secret = secret_folder(outside, "chain", SMALL_BYTES)
    (root / "chain-hop").symlink_to(secret, target_is_directory=True)
    (root / "chain-start").symlink_to("chain-hop", target_is_directory=True)
    climbing = root / "chain-climb"
    climbing.mkdir()
    (climbing / WEIGHTS).symlink_to(Path("..") / ".." / outside.name / "chain" / WEIGHTS)
    assert (climbing / WEIGHTS).resolve() == (secret / WEIGHTS).resolve()
    for model in ("chain-start", "chain-climb"):
        with pytest.raises(grpc.RpcError) as info:
            stub.GetManifest(pb.GetManifestRequest(model=model), timeout=CALL_TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (model, info.value.details())
        code, payload = received(stub.ReadModelFile(read_request(model), timeout=CALL_TIMEOUT_S))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert_no_secret(payload)
