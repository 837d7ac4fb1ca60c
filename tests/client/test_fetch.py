"""fetch: a model's weights and companion files written to a folder, bit-identical and resumable.

Real servers on loopback (local model root and s3rver), real files; nothing is faked.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.support.checkpoints import llama_config
from tests.support.s3_stores import S3_BUCKET, S3Process, upload_folder
from weightstream.client import (
    FailedPreconditionError,
    IntegrityError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    WeightStreamClient,
)
from weightstream.client.fetch import partial_path
from weightstream_server import WeightStreamServer
from weightstream_server.serving.files import MAX_COMPANION_BYTES

MODEL = "fetch-llama"
S3_MODEL = f"s3://{S3_BUCKET}/fetch/llama"
COMPANIONS = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
}
PRIVATE = ("secret.txt", "stray.safetensors")
COMMAND_TIMEOUT_S = 60.0


def sha256s(folder: Path) -> dict[str, str]:
    """sha256 of every file directly in folder, hidden ones included, by name."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def model_folder(model_root: Path, tiny_llama_folder: Path) -> Path:
    """A tiny Llama with the files an engine needs, plus files the server must never serve."""
    folder = model_root / MODEL
    shutil.copytree(tiny_llama_folder, folder)
    llama_config().to_json_file(str(folder / "config.json"))
    (folder / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}\n')
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": {}}}\n' * 2000)
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    (folder / "special_tokens_map.json").write_text('{"bos_token": "<s>"}\n')
    (folder / "tokenizer.model").write_bytes(os.urandom(300_000))
    (folder / "secret.txt").write_text("not for clients\n")
    # A safetensors file the index does not name is not a weight file of the model.
    shutil.copyfile(next(folder.glob("model-*.safetensors")), folder / "stray.safetensors")
    return folder


def expected_files(folder: Path, *, weights: bool = True) -> dict[str, str]:
    hashes = sha256s(folder)
    return {
        n: h for n, h in hashes.items() if n in COMPANIONS or (weights and n.startswith("model-") and n not in PRIVATE)
    }


def test_fetch_of_a_local_model_is_bit_identical(
    model_folder: Path, client: WeightStreamClient, tmp_path: Path
) -> None:
    listing = client.list_files(MODEL)
    kinds = {f.name: f.kind for f in listing.files}
    assert {n for n, k in kinds.items() if k == "companion"} == COMPANIONS
    assert len([k for k in kinds.values() if k == "weights"]) == 3
    assert not set(PRIVATE) & kinds.keys()

    report = client.fetch(MODEL, tmp_path / "out")
    expected = expected_files(model_folder)
    assert sha256s(tmp_path / "out") == expected
    assert sorted(report.downloaded) == sorted(expected) and not report.resumed and not report.skipped
    assert report.bytes == sum((model_folder / n).stat().st_size for n in expected)


@pytest.mark.slow
def test_fetch_of_an_s3_model_is_bit_identical(
    model_folder: Path, s3_store: S3Process, s3_target: str, tmp_path: Path
) -> None:
    upload_folder(s3_store.client(), model_folder, S3_BUCKET, "fetch/llama")
    with WeightStreamClient(s3_target, progress=False, chunk_bytes=64 * 1024) as client:
        report = client.fetch(S3_MODEL, tmp_path / "out")
        assert sha256s(tmp_path / "out") == expected_files(model_folder)
        assert len(report.downloaded) == len(COMPANIONS) + 3
        with pytest.raises(PermissionDeniedError, match=r"'secret\.txt'") as info:
            list(client.read_file(S3_MODEL, "secret.txt"))
        assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
        # Resume against S3: ranged GETs from the partial file's length.
        shard = next(n for n in sorted(report.files) if n.endswith(".safetensors"))
        data = (tmp_path / "out" / shard).read_bytes()
        (tmp_path / "out" / shard).unlink()
        partial_path(tmp_path / "out", shard).write_bytes(data[: len(data) // 3])
        again = client.fetch(S3_MODEL, tmp_path / "out")
    assert again.resumed == [shard] and again.bytes == len(data) - len(data) // 3
    assert sha256s(tmp_path / "out") == expected_files(model_folder)


def test_resume_sends_only_what_is_missing(
    model_folder: Path, client: WeightStreamClient, server: WeightStreamServer, tmp_path: Path
) -> None:
    """A complete file is skipped, truncated .partial files are continued: only the missing bytes travel."""
    out = tmp_path / "out"
    out.mkdir()
    shards = sorted(p.name for p in model_folder.glob("model-*.safetensors"))
    shutil.copyfile(model_folder / shards[0], out / shards[0])
    shard_bytes = (model_folder / shards[1]).read_bytes()
    partial_path(out, shards[1]).write_bytes(shard_bytes[:10_000])
    config = (model_folder / "config.json").read_bytes()
    partial_path(out, "config.json").write_bytes(config[:7])
    expected = expected_files(model_folder)
    complete = (model_folder / shards[0]).stat().st_size
    missing = sum((model_folder / n).stat().st_size for n in expected) - complete - 10_000 - 7
    before = server.stats.snapshot().bytes_served_total

    report = client.fetch(MODEL, out)

    assert server.stats.snapshot().bytes_served_total - before == missing == report.bytes
    assert report.skipped == [shards[0]]
    assert sorted(report.resumed) == sorted([shards[1], "config.json"])
    assert sha256s(out) == expected
    assert client.fetch(MODEL, out).bytes == 0


def test_a_cancelled_stream_is_resumed(model_folder: Path, target: str, tmp_path: Path) -> None:
    """The first pieces of a file are written, the stream is abandoned; the next fetch completes it."""
    out = tmp_path / "out"
    out.mkdir()
    name = "tokenizer.model"
    with WeightStreamClient(target, progress=False, chunk_bytes=16 * 1024) as client:
        pieces = client.read_file(MODEL, name, revision=client.list_files(MODEL).revision)
        with partial_path(out, name).open("wb") as partial:
            for count, (data, _crc) in enumerate(pieces, start=1):
                partial.write(data)
                if count == 3:
                    break
        pieces.close()  # cancels the call mid-stream
        assert partial_path(out, name).stat().st_size == 3 * 16 * 1024
        report = client.fetch(MODEL, out, metadata_only=True)
    assert name in report.resumed
    assert report.bytes == sum((model_folder / n).stat().st_size for n in COMPANIONS) - 3 * 16 * 1024
    assert sha256s(out) == expected_files(model_folder, weights=False)


def test_a_stale_partial_file_is_caught_removed_and_refetched(
    model_folder: Path, client: WeightStreamClient, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    partial_path(out, "tokenizer.json").write_bytes(b"X" * 1000)
    with pytest.raises(IntegrityError, match=r"'tokenizer\.json'.*CRC32C.*fetch again") as info:
        client.fetch(MODEL, out, metadata_only=True)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert not partial_path(out, "tokenizer.json").exists()
    client.fetch(MODEL, out, metadata_only=True)
    assert sha256s(out) == expected_files(model_folder, weights=False)


def test_metadata_only_writes_only_companion_files(
    model_folder: Path, client: WeightStreamClient, tmp_path: Path
) -> None:
    report = client.fetch(MODEL, tmp_path / "meta", metadata_only=True)
    assert set(sha256s(tmp_path / "meta")) == COMPANIONS == set(report.files)
    assert sha256s(tmp_path / "meta") == expected_files(model_folder, weights=False)


@pytest.mark.usefixtures("model_folder")
@pytest.mark.parametrize("name", ["secret.txt", "stray.safetensors"])
def test_a_file_not_on_the_allowlist_is_permission_denied(client: WeightStreamClient, name: str) -> None:
    with pytest.raises(PermissionDeniedError, match=rf"model '{MODEL}': file '{name}' is neither") as info:
        list(client.read_file(MODEL, name))
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED


@pytest.mark.usefixtures("model_folder")
@pytest.mark.parametrize(
    "name", ["../fetch-llama/config.json", "a/config.json", "..", ".config.json", "", "/etc/passwd"]
)
def test_a_name_that_is_not_one_plain_name_is_invalid(client: WeightStreamClient, name: str) -> None:
    with pytest.raises(InvalidArgumentError, match="invalid file name") as info:
        list(client.read_file(MODEL, name))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.usefixtures("model_folder")
def test_an_allowed_name_the_model_lacks_is_not_found(client: WeightStreamClient) -> None:
    with pytest.raises(NotFoundError, match=rf"model '{MODEL}' has no file 'vocab\.json'") as info:
        list(client.read_file(MODEL, "vocab.json"))
    assert info.value.code == grpc.StatusCode.NOT_FOUND


def test_an_oversized_companion_file_is_failed_precondition(
    model_root: Path, tiny_llama_folder: Path, client: WeightStreamClient, tmp_path: Path
) -> None:
    folder = model_root / "fetch-huge-tokenizer"
    shutil.copytree(tiny_llama_folder, folder)
    with (folder / "tokenizer.json").open("wb") as f:
        f.truncate(MAX_COMPANION_BYTES + 1)  # sparse: no disk is spent
    with pytest.raises(FailedPreconditionError, match=r"'tokenizer\.json' has 67108865 bytes, more than") as info:
        list(client.read_file("fetch-huge-tokenizer", "tokenizer.json"))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(FailedPreconditionError, match=r"tokenizer\.json"):
        client.fetch("fetch-huge-tokenizer", tmp_path / "out", metadata_only=True)


def test_a_companion_symlink_outside_the_root_is_refused(
    model_root: Path, tiny_llama_folder: Path, client: WeightStreamClient, tmp_path: Path
) -> None:
    folder = model_root / "fetch-escaping-config"
    shutil.copytree(tiny_llama_folder, folder)
    (tmp_path / "private.json").write_text("{}")
    (folder / "config.json").symlink_to(tmp_path / "private.json")
    with pytest.raises(PermissionDeniedError, match=r"'config\.json' resolves outside the model root") as info:
        client.fetch("fetch-escaping-config", tmp_path / "out")
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.usefixtures("model_folder")
def test_offset_past_the_end_and_a_changed_revision_are_refused(client: WeightStreamClient) -> None:
    with pytest.raises(InvalidArgumentError, match="past the end") as info:
        list(client.read_file(MODEL, "config.json", offset=10**9))
    assert info.value.code == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(FailedPreconditionError, match="changed"):
        list(client.read_file(MODEL, "config.json", revision="not-the-revision"))


@pytest.mark.slow
def test_cli_fetch_end_to_end(model_folder: Path, target: str, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTSTREAM_")}

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "weightstream", "fetch", MODEL, str(out), "--target", target, *extra]
        return subprocess.run(command, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=env)

    meta = run("--metadata-only", "--no-progress")
    assert meta.returncode == 0, meta.stderr
    assert set(sha256s(out)) == COMPANIONS
    full = run()
    assert full.returncode == 0, full.stderr
    assert f"{len(COMPANIONS) + 3} files (3 downloaded, 0 resumed, {len(COMPANIONS)} already complete)" in full.stdout
    assert "fetch fetch-llama" in full.stderr  # the progress bar
    assert sha256s(out) == expected_files(model_folder)
    again = run("--no-progress")
    assert again.returncode == 0 and "0 downloaded" in again.stdout and again.stderr == ""
    refused = subprocess.run(
        [sys.executable, "-m", "weightstream", "fetch", "no-such-model", str(tmp_path / "x"), "--target", target],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        env=env,
    )
    assert refused.returncode == 1 and "NOT_FOUND" in refused.stderr and "no-such-model" in refused.stderr
