"""`weightstream serve` in its own process: started, waited for, stopped, or supervised and restarted.

start_serve() is the one place such a process is started: serve_process() runs one for a block and
kills it on the way out; Supervisor starts it again whenever it dies (tests kill it with SIGKILL).
Every server listens on 127.0.0.1 only, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from benchmarks.harness import stop_process
from tests.support.commands import clean_env, weightstream_cmd
from tests.support.ports import LISTEN_TIMEOUT_S, LOOPBACK, free_ports, wait_port
from weightstream.client import UnavailableError, WeightStreamClient

READY_TIMEOUT_S = 30.0
POLL_S = 0.1
STOP_TIMEOUT_S = 20.0


def start_serve(
    args: Sequence[str],
    log: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> subprocess.Popen[bytes]:
    """Start `weightstream serve ARGS` with its output appended to log; env defaults to clean_env().
    wrap, if given, turns the command into the one run (object_stores.namespaced, say).

    The data port is off (WEIGHTSTREAM_DATA_PORT=0) unless args or env set it: servers of the suite
    must not all bind its default port.
    """
    env = dict(env or clean_env())
    env.setdefault("WEIGHTSTREAM_DATA_PORT", "0")
    with log.open("ab") as sink:
        command = [*weightstream_cmd(), "serve", *args]
        return subprocess.Popen(
            wrap(command) if wrap else command,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
        )


@dataclass
class ServerProcess:
    """A `weightstream serve` process and the log file its output goes to."""

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

    def wait_listening(self, port: int, timeout: float = LISTEN_TIMEOUT_S) -> None:
        """Wait until the server accepts TCP connections on 127.0.0.1:port; fails if it exits first."""
        try:
            wait_port(port, timeout, alive=lambda: self.proc.poll() is None)
        except (RuntimeError, TimeoutError) as exc:
            pytest.fail(f"{exc}:\n{self.output()}")


@contextlib.contextmanager
def serve_process(
    args: list[str],
    workdir: Path,
    env: dict[str, str] | None = None,
    log: Path | None = None,
    wrap: Callable[[list[str]], list[str]] | None = None,
) -> Iterator[ServerProcess]:
    """`weightstream serve ARGS` in workdir, its output in log (workdir/serve.log); always killed on the way out."""
    log = log or workdir / "serve.log"
    proc = start_serve(args, log, env, cwd=workdir, wrap=wrap)
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


class Supervisor:
    """`weightstream serve` on a fixed port, restarted whenever it dies until stop().

    restart_delay: seconds between a death and the next start (a real restart is that late, plus
    the process's own start-up). before_restart, when set, runs after a death and before the next
    start (a test rewrites a checkpoint there). Output of every run goes to log_dir/server-N.log.
    One watcher thread waits on the running process; kill(), wait_started() and stop() may be
    called from any thread, and no process is started once stop() has begun.
    """

    def __init__(
        self, model_root: Path, log_dir: Path, *args: str, port: int | None = None, restart_delay: float = 0.0
    ) -> None:
        self.port = port or free_ports(1)[0]
        self.target = f"{LOOPBACK}:{self.port}"
        self._args = [
            "--model-root",
            str(model_root),
            "--host",
            LOOPBACK,
            "--grpc-port",
            str(self.port),
            "--http-port",
            "0",
            "--log-level",
            "WARNING",
            *args,
        ]
        self._log_dir = log_dir
        self.restart_delay = restart_delay
        # Guards _proc, _stopping and starts; notified at every start.
        self._lock = threading.Condition()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.starts = 0
        self.kills = 0
        self.before_restart: Callable[[], None] | None = None

    @property
    def pid(self) -> int:
        with self._lock:
            assert self._proc is not None
            return self._proc.pid

    def start(self) -> Supervisor:
        self._spawn()
        wait_port(self.port, alive=self._alive)
        self._thread = threading.Thread(target=self._watch, name="chaos-supervisor", daemon=True)
        self._thread.start()
        return self

    def kill(self) -> bool:
        """SIGKILL the running server (the supervisor starts the next one); False if none was running."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                os.kill(self._proc.pid, signal.SIGKILL)
                self.kills += 1
                return True
        return False

    def wait_serving(self, timeout: float = LISTEN_TIMEOUT_S) -> None:
        wait_port(self.port, timeout)

    def wait_started(self, starts: int, timeout: float = LISTEN_TIMEOUT_S) -> bool:
        """Wait until the process numbered starts (from 1) has been started; False after timeout or stop()."""
        with self._lock:
            return self._lock.wait_for(lambda: self.starts >= starts or self._stopping, timeout) and not self._stopping

    def stop(self) -> None:
        with self._lock:
            self._stopping = True  # from here on _spawn starts nothing, so proc is the last process
            proc = self._proc
            self._lock.notify_all()
        self._stopped.set()
        if proc is not None and proc.poll() is None:
            stop_process(proc)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-4000:] for p in sorted(self._log_dir.glob("server-*.log")))

    def __enter__(self) -> Supervisor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _alive(self) -> bool:
        with self._lock:
            return self._proc is not None and self._proc.poll() is None

    def _spawn(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self.starts += 1
            self._proc = start_serve(self._args, self._log_dir / f"server-{self.starts}.log")
            self._lock.notify_all()

    def _watch(self) -> None:
        while True:
            with self._lock:
                proc = self._proc
            assert proc is not None
            proc.wait()
            if self._stopped.wait(self.restart_delay):
                return
            if self.before_restart is not None:
                hook, self.before_restart = self.before_restart, None
                hook()
            self._spawn()
