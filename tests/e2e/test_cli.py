"""The `weightstream` command, run as a real process: version, help, demo, serve, manifest, load.

Every server here listens on 127.0.0.1 only, and every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

import weightstream
from tests.support.commands import COMMAND_TIMEOUT_S, clean_env, console_script, describe, run_cli
from tests.support.ports import LOOPBACK, free_ports
from tests.support.serve_processes import serve_process, wait_grpc_ready, wait_http_ready
from weightstream import demo
from weightstream.cli import build_parser
from weightstream.samples import llama_like_state_dict, save_sharded
from weightstream_server.settings import ServerSettings, env_name, flag

MODEL = "tiny"
DEMO_TIMEOUT_S = 120.0


# --- the checkpoint the servers serve ------------------------------------------------------------


@dataclass
class Checkpoint:
    root: Path
    state: dict[str, torch.Tensor]

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


@pytest.fixture
def tiny_checkpoint(tmp_path: Path) -> Checkpoint:
    """A model root (tmp_path) holding one small two-shard model, MODEL."""
    state = llama_like_state_dict(layers=1, hidden=64, intermediate=128, vocab=256)
    save_sharded(state, tmp_path / MODEL, shards=2)
    return Checkpoint(tmp_path, state)


# --- version, help, demo -------------------------------------------------------------------------


def test_console_script_is_installed() -> None:
    script = console_script()
    assert script is not None, "the weightstream console script is not installed next to the interpreter"
    assert os.access(script, os.X_OK)


@pytest.mark.parametrize("how", ["script", "module"])
def test_version(how: str, tmp_path: Path) -> None:
    if how == "script":
        assert console_script() is not None
    result = run_cli("--version", how=how, cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    assert result.stdout.strip() == f"weightstream {weightstream.__version__}", describe(result)


def test_help(tmp_path: Path) -> None:
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    for command in ("serve", "demo", "manifest", "load"):
        assert command in result.stdout, describe(result)


def test_every_command_says_what_it_does_today() -> None:
    """Each subcommand has a help line and a description; serve's name every source, the tiers and publishing, the
    demo's its live update."""
    parser = build_parser()
    (commands,) = (action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    helps = {action.dest: action.help or "" for action in commands._choices_actions}
    descriptions = {name: sub.description or "" for name, sub in commands.choices.items()}
    for name in commands.choices:
        assert helps[name] and descriptions[name], f"{name} has no help line or no description"
    for what in ("folder", "S3", "GCS", "Azure", "another server", "publish"):
        assert what in helps["serve"], (what, helps["serve"])
    for what in (
        "--model-root",
        "--s3-bucket",
        "--gcs-bucket",
        "--azure-container",
        "--upstream",
        "--cache-bytes",
        "--disk-cache",
        "--data-port",
        "--shm-dir",
        "--http-port",
        "--keep-revisions",
        "--allow-publish",
        "--publish-token-file",
    ):
        assert what in descriptions["serve"], (what, descriptions["serve"])
    for what in ("publish", "update", "in place", "verify"):
        assert what in descriptions["demo"], (what, descriptions["demo"])
    for what in ("S3", "Google Cloud Storage", "Azure", "publish"):
        assert what in (parser.description or ""), (what, parser.description)


def test_serve_help(tmp_path: Path) -> None:
    """Every ServerSettings field is an option whose help is its description, its default and its variable."""
    result = run_cli("serve", "--help", cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    # argparse wraps lines (at hyphens too), so compare without any whitespace.
    text = "".join(result.stdout.split())
    for name, field in ServerSettings.model_fields.items():
        assert field.description, f"{name} has no description, so no --help line"
        for part in (flag(name), field.description, f"[env{env_name(name)}]"):
            assert "".join(part.split()) in text, f"{part!r} missing from serve --help:\n{describe(result)}"
    for default in ("(default:127.0.0.1)", "(default:50051)", "(default:256MiB)", "(default:4MiB)", "(default:off)"):
        assert default in text, f"{default!r} missing from serve --help:\n{describe(result)}"
    assert text.count("(default:") == len(ServerSettings.model_fields), describe(result)


def test_serve_without_the_server_installed_says_what_to_install(tmp_path: Path) -> None:
    """A client-only install, made here by blocking imports: it has no pydantic and no weightstream_server."""
    code = """
        import contextlib
        import importlib.abc
        import io
        import sys

        BLOCKED = ("pydantic", "pydantic_core", "pydantic_settings", "weightstream_server")

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"No module named {name!r} (blocked: client-only install)")
                return None

        sys.meta_path.insert(0, Block())
        for name in [m for m in sys.modules if m.split(".")[0] in BLOCKED]:
            del sys.modules[name]

        from weightstream.cli import build_parser, main

        assert "serve" in build_parser().format_help()

        def run(*argv):
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    code = main(list(argv))
                except SystemExit as exc:
                    code = exc.code
            return code, err.getvalue()

        assert run("--help") == (0, ""), run("--help")
        assert run("serve", "--help")[0] == 0
        code, err = run("serve", "--model-root", "/models", "--cache-bytes", "16GiB")
        print(code)
        print(err.strip())
        code, err = run("serve")
        print(code)
        print(err.strip())
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, loaded
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        cwd=tmp_path,
        check=False,
    )
    assert result.returncode == 0, describe(result)
    lines = result.stdout.splitlines()
    assert lines[0] == lines[2] == "2", describe(result)
    for line in (lines[1], lines[3]):
        assert line.startswith("weightstream serve needs the server's dependencies: "), describe(result)
        assert "pip install 'weightstream[server]'" in line, describe(result)
        assert "No module named" in line, describe(result)


@pytest.mark.slow
def test_demo(tmp_path: Path) -> None:
    """The demo loads, verifies, publishes a revision with a few tensors changed and updates in place, moving
    only the changed tensors' bytes, and verifies again."""
    result = run_cli("demo", cwd=tmp_path, timeout=DEMO_TIMEOUT_S)
    assert result.returncode == 0, describe(result)
    lines = {line.split(":", 1)[0]: line for line in result.stdout.splitlines()}
    assert "GB/s" in lines["load_into"], describe(result)
    state = llama_like_state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    changed = sum(state[name].numel() * state[name].element_size() for name in demo.UPDATED)
    assert 0 < changed < total // 10
    assert f"update_into moved {changed:,d} bytes of the model's {total:,d}" in lines["update"], describe(result)
    assert f"{len(demo.UPDATED)} tensors, in place" in lines["update"], describe(result)
    published = lines["publish"].split()[2].rstrip(":")
    assert published.startswith("pub-"), describe(result)
    assert f"to {published}" in lines["update"], describe(result)
    verified = [line for line in result.stdout.splitlines() if line.startswith("verify:")]
    assert verified == [
        f"verify:     all {len(state)} tensors bit-identical to the checkpoint",
        f"verify:     all {len(state)} tensors bit-identical to revision {published}",
    ], describe(result)


def test_the_demo_revision_changes_every_updated_tensor_and_nothing_else() -> None:
    """What the demo's update test counts on: the changed bytes are exactly the UPDATED tensors'."""
    state = llama_like_state_dict(layers=4, hidden=64, intermediate=128, vocab=256)
    nudged = demo.next_revision(state)
    assert sorted(nudged) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(nudged[name], tensor) == (name not in demo.UPDATED), name


# --- serve ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_serve_manifest_load_and_sigterm(tiny_checkpoint: Checkpoint, tmp_path: Path, http: httpx.Client) -> None:
    grpc_port, http_port = free_ports(2)
    target = f"{LOOPBACK}:{grpc_port}"
    base = f"http://{LOOPBACK}:{http_port}"
    state = tiny_checkpoint.state
    args = [
        "--model-root",
        str(tiny_checkpoint.root),
        "--host",
        LOOPBACK,
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        str(http_port),
    ]
    with serve_process(args, tmp_path) as server:
        wait_http_ready(server, http, f"{base}/readyz")

        health = http.get(f"{base}/healthz", timeout=5.0)
        assert health.status_code == 200
        assert health.json() == {"status": "ok"}

        status = http.get(f"{base}/status", timeout=5.0)
        assert status.status_code == 200
        body = status.json()
        assert body["version"] == weightstream.__version__
        assert body["grpc_port"] == grpc_port
        assert body["streams_total"] == 0

        # manifest --json: the same tensors as the checkpoint.
        result = run_cli("manifest", MODEL, "--target", target, "--json", cwd=tmp_path)
        assert result.returncode == 0, describe(result)
        listed = json.loads(result.stdout)
        assert listed["model"] == MODEL
        assert listed["total_bytes"] == tiny_checkpoint.total_bytes
        assert len(listed["files"]) == 2
        got = {t["name"]: (t["shape"], t["dtype"], t["nbytes"]) for t in listed["tensors"]}
        want = {
            name: (list(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
            for name, t in state.items()
        }
        assert got == want
        assert len(listed["tensors"]) == len(state)

        # manifest as a table.
        result = run_cli("manifest", MODEL, "--target", target, cwd=tmp_path)
        assert result.returncode == 0, describe(result)
        assert f"{len(state)} tensors, {tiny_checkpoint.total_bytes:,d} bytes in 2 files" in result.stdout
        for name in state:
            assert name in result.stdout

        # load: streams every tensor.
        result = run_cli("load", MODEL, "--target", target, "--no-progress", cwd=tmp_path)
        assert result.returncode == 0, describe(result)
        assert "GB/s" in result.stdout, describe(result)
        counted = f"{len(state)} tensors, {tiny_checkpoint.total_bytes:,d} bytes"
        assert counted in result.stdout, describe(result)

        # An unknown model: exit 1 and the gRPC status on stderr.
        result = run_cli("manifest", "no-such-model", "--target", target, cwd=tmp_path)
        assert result.returncode == 1, describe(result)
        assert "NOT_FOUND" in result.stderr, describe(result)
        assert result.stdout == "", describe(result)

        status = http.get(f"{base}/status", timeout=5.0).json()
        assert status["streams_total"] >= 1
        assert status["bytes_served_total"] >= tiny_checkpoint.total_bytes

        server.assert_running()
        code = server.terminate_and_wait()
        assert code == 0, server.output()


@pytest.mark.slow
def test_serve_configured_by_environment(tiny_checkpoint: Checkpoint, tmp_path: Path, no_proxy: None) -> None:
    (grpc_port,) = free_ports(1)
    env = clean_env(
        WEIGHTSTREAM_MODEL_ROOT=str(tiny_checkpoint.root),
        WEIGHTSTREAM_HOST=LOOPBACK,
        WEIGHTSTREAM_GRPC_PORT=str(grpc_port),
        WEIGHTSTREAM_HTTP_PORT="0",
    )
    with serve_process([], tmp_path, env=env) as server:
        tensors = wait_grpc_ready(server, f"{LOOPBACK}:{grpc_port}", MODEL)
        assert tensors == len(tiny_checkpoint.state)
        code = server.terminate_and_wait()
        assert code == 0, server.output()
    assert f"grpc_port={grpc_port}" in server.output()
    # WEIGHTSTREAM_HTTP_PORT=0 turns the REST endpoint off.
    assert "REST endpoint" not in server.output()


@pytest.mark.slow
def test_serve_without_model_root(tmp_path: Path) -> None:
    result = run_cli("serve", cwd=tmp_path)
    assert result.returncode == 2, describe(result)
    assert "--model-root" in result.stderr, describe(result)


@pytest.mark.slow
def test_serve_with_missing_model_root(tmp_path: Path) -> None:
    missing = "/nonexistent/dir"
    assert not Path(missing).exists()
    result = run_cli("serve", "--model-root", missing, cwd=tmp_path)
    assert result.returncode != 0, describe(result)
    assert missing in result.stderr, describe(result)


@pytest.mark.parametrize("busy", ["grpc", "http"])
@pytest.mark.slow
def test_serve_on_a_busy_port_fails(tiny_checkpoint: Checkpoint, tmp_path: Path, busy: str) -> None:
    """A port already in use is an error at start-up, for gRPC and REST alike (no silent sharing)."""
    holder = socket.create_server((LOOPBACK, 0))
    try:
        taken = holder.getsockname()[1]
        (other,) = free_ports(1)
        grpc_port, http_port = (taken, other) if busy == "grpc" else (other, taken)
        result = run_cli(
            "serve",
            "--model-root",
            str(tiny_checkpoint.root),
            "--host",
            LOOPBACK,
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            cwd=tmp_path,
            timeout=60,
        )
    finally:
        holder.close()
    assert result.returncode == 1, describe(result)
    assert str(taken) in result.stderr or "in use" in result.stderr, describe(result)
