"""The `weightstream` command, run as a real process: version, help, demo, serve, manifest, load.

Every server here listens on 127.0.0.1 only, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

import weightstream
from weightstream.client import UnavailableError, WeightStreamClient
from weightstream.demo import llama_like_state_dict, save_sharded

MODEL = "tiny"
READY_TIMEOUT_S = 30.0
POLL_S = 0.1
STOP_TIMEOUT_S = 20.0
COMMAND_TIMEOUT_S = 60.0
DEMO_TIMEOUT_S = 120.0
LOOPBACK = "127.0.0.1"


# --- helpers -------------------------------------------------------------------------------------


def console_script() -> str | None:
    """The installed `weightstream` script: next to this interpreter first, then on PATH."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which("weightstream", path=search)


def weightstream_cmd(how: str = "script") -> list[str]:
    """The command that runs the CLI: the console script, or `python -m weightstream`."""
    if how == "module":
        return [sys.executable, "-m", "weightstream"]
    script = console_script()
    return [script] if script else [sys.executable, "-m", "weightstream"]


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without WEIGHTSTREAM_* settings and proxies, plus extra."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("WEIGHTSTREAM_") and k.lower() not in ("http_proxy", "https_proxy", "all_proxy")
    }
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env.update(extra)
    return env


def run_cli(
    *args: str,
    how: str = "script",
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = COMMAND_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*weightstream_cmd(how), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
        cwd=cwd,
        check=False,
    )


def free_ports(count: int) -> list[int]:
    """count distinct free TCP ports on 127.0.0.1 (bound to port 0 together, then released)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def describe(result: subprocess.CompletedProcess[str]) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def assert_running(self) -> None:
        code = self.proc.poll()
        assert code is None, f"weightstream serve exited early with {code}:\n{self.output()}"

    def terminate_and_wait(self) -> int:
        """Send SIGTERM; the exit code, or a failure if it does not exit within STOP_TIMEOUT_S."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"weightstream serve still running {STOP_TIMEOUT_S} s after SIGTERM:\n{self.output()}")


@contextlib.contextmanager
def serve_process(args: list[str], workdir: Path, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """Start `weightstream serve ARGS` with its output in a log file; always killed on the way out."""
    log = workdir / "serve.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [*weightstream_cmd(), "serve", *args],
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env or clean_env(),
            cwd=workdir,
        )
    server = ServerProcess(proc, log)
    try:
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)


def wait_http_ready(server: ServerProcess, http: httpx.Client, url: str) -> None:
    """Poll url every POLL_S until it answers 200; fails after READY_TIMEOUT_S or if the server exits."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        server.assert_running()
        try:
            response = http.get(url, timeout=2.0)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(POLL_S)
    pytest.fail(f"{url} not ready after {READY_TIMEOUT_S} s (last: {last}):\n{server.output()}")


def wait_grpc_ready(server: ServerProcess, target: str, model: str) -> int:
    """Poll a manifest call until the server answers; returns the manifest's tensor count."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        server.assert_running()
        # A fresh channel per try, so that gRPC's reconnect backoff does not stretch the wait.
        with WeightStreamClient(target, progress=False, timeout=2.0) as client:
            try:
                return len(client.manifest(model).tensors)
            except UnavailableError as exc:
                last = str(exc)
        time.sleep(POLL_S)
    pytest.fail(f"gRPC on {target} not answering after {READY_TIMEOUT_S} s (last: {last}):\n{server.output()}")


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


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    # trust_env=False: never send loopback requests through a proxy from the environment.
    with httpx.Client(trust_env=False) as client:
        yield client


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep this process's gRPC channels off any proxy from the environment."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


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


def test_serve_help(tmp_path: Path) -> None:
    result = run_cli("serve", "--help", cwd=tmp_path)
    assert result.returncode == 0, describe(result)
    for text in ("--model-root", "--grpc-port", "--http-port", "WEIGHTSTREAM_MODEL_ROOT"):
        assert text in result.stdout, f"{text!r} missing from serve --help:\n{describe(result)}"


def test_demo(tmp_path: Path) -> None:
    result = run_cli("demo", cwd=tmp_path, timeout=DEMO_TIMEOUT_S)
    assert result.returncode == 0, describe(result)
    assert "bit-identical" in result.stdout, describe(result)
    assert "GB/s" in result.stdout, describe(result)


# --- serve ---------------------------------------------------------------------------------------


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


def test_serve_without_model_root(tmp_path: Path) -> None:
    result = run_cli("serve", cwd=tmp_path)
    assert result.returncode == 2, describe(result)
    assert "--model-root" in result.stderr, describe(result)


def test_serve_with_missing_model_root(tmp_path: Path) -> None:
    missing = "/nonexistent/dir"
    assert not Path(missing).exists()
    result = run_cli("serve", "--model-root", missing, cwd=tmp_path)
    assert result.returncode != 0, describe(result)
    assert missing in result.stderr, describe(result)


@pytest.mark.parametrize("busy", ["grpc", "http"])
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
