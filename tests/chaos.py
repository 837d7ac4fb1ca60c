"""Fault injection for the reliability tests: a supervised server process, and a TCP proxy that cuts connections.

Everything listens on 127.0.0.1 only. Supervisor runs `weightstream serve` in its own process on a
fixed port and starts it again whenever it dies (tests kill it with SIGKILL). CuttingProxy relays
TCP between a client and a server and, on the connections it is told to, resets the connection
after a given number of bytes from the server, or stops relaying (a peer that vanished without
closing anything).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path

import torch

from weightstream.bench import rss, stop_process

LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 60.0
# Relay unit of the proxy: large enough for loopback speed, small enough that cuts land near their mark.
RELAY_BYTES = 256 * 1024


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = READY_TIMEOUT_S, alive: Callable[[], bool] = lambda: True) -> None:
    """Wait until something accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server on port {port} died before it was ready")
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), timeout=1.0):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {LOOPBACK}:{port} after {timeout} s")


class Supervisor:
    """`weightstream serve` on a fixed port, restarted whenever it dies until stop().

    before_restart, when set, runs after a death and before the next start (a test rewrites a
    checkpoint there). Output of every run goes to log_dir/server-N.log.
    """

    def __init__(self, model_root: Path, log_dir: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.target = f"{LOOPBACK}:{self.port}"
        self._command = [
            sys.executable,
            "-m",
            "weightstream",
            "serve",
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
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = False
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

    def kill(self) -> None:
        """SIGKILL the running server (the supervisor starts the next one)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                os.kill(self._proc.pid, signal.SIGKILL)
                self.kills += 1

    def wait_serving(self, timeout: float = READY_TIMEOUT_S) -> None:
        wait_port(self.port, timeout)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            proc = self._proc
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
        self.starts += 1
        log = (self._log_dir / f"server-{self.starts}.log").open("wb")
        with self._lock:
            self._proc = subprocess.Popen(self._command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()

    def _watch(self) -> None:
        while True:
            with self._lock:
                proc = self._proc
            assert proc is not None
            proc.wait()
            with self._lock:
                if self._stopping:
                    return
            if self.before_restart is not None:
                hook, self.before_restart = self.before_restart, None
                hook()
            self._spawn()


class CuttingProxy:
    """A TCP relay from 127.0.0.1:port to a server; connection i (from 0) is cut per plan[i].

    plan[i] is (bytes, how): after that many bytes from the server, "reset" closes both sides with
    an RST, "freeze" stops relaying both ways but keeps the sockets open. Connections past the plan
    are relayed untouched. At most max_connections are accepted; two threads relay each one.
    """

    def __init__(self, upstream_port: int, plan: Sequence[tuple[int, str]], max_connections: int = 32) -> None:
        self._upstream = upstream_port
        self._plan = list(plan)
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = int(self._listener.getsockname()[1])
        self.target = f"{LOOPBACK}:{self.port}"
        self._pool = futures.ThreadPoolExecutor(max_workers=2 * max_connections + 1, thread_name_prefix="chaos-proxy")
        self._max = max_connections
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.connections = 0
        self.cuts = 0
        self.relayed = 0  # bytes from the server, over all connections

    def __enter__(self) -> CuttingProxy:
        self._pool.submit(self._accept)
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        # close() does not wake a thread blocked in accept(); shutdown does.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                index = self.connections
                self.connections += 1
            if index >= self._max:
                client.close()
                continue
            server = socket.create_connection((LOOPBACK, self._upstream), timeout=10)
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            limit, how = self._plan[index] if index < len(self._plan) else (None, "")
            pair = _Pair(client, server)
            self._pool.submit(self._relay, pair, client, server, False, None, "")
            self._pool.submit(self._relay, pair, server, client, True, limit, how)

    def _relay(
        self,
        pair: _Pair,
        source: socket.socket,
        sink: socket.socket,
        from_server: bool,
        limit: int | None,
        how: str,
    ) -> None:
        sent = 0
        try:
            while not self._closed.is_set():
                data = source.recv(RELAY_BYTES if limit is None else max(1, min(RELAY_BYTES, limit - sent)))
                if not data:
                    break
                if pair.frozen.is_set():
                    continue  # swallowed: a frozen peer answers nothing, not even pings
                sink.sendall(data)
                sent += len(data)
                if from_server:
                    with self._lock:
                        self.relayed += len(data)
                if limit is not None and sent >= limit:
                    with self._lock:
                        self.cuts += 1
                    if how == "freeze":
                        pair.frozen.set()
                        self._closed.wait()  # the peer must notice by itself that nothing comes any more
                        return
                    pair.reset()
                    return
        except OSError:
            pass
        finally:
            pair.finished()


class _Pair:
    """The two sockets of one relayed connection; the last of its two relay threads closes them.

    Closing a socket that another thread is blocked on would let its descriptor number be reused
    by the next connection under that thread; SHUT_RD wakes the blocked thread instead.
    """

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.sockets = (client, server)
        self.frozen = threading.Event()
        self._lock = threading.Lock()
        self._running = 2

    def reset(self) -> None:
        """Make the close send RST to both peers, as a crashed peer's kernel would, and wake the other thread."""
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RD)

    def finished(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if not last:
            for s in self.sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RD)
            return
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (a CPU tensor; made contiguous first)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(memoryview(flat.numpy())).hexdigest()


def digests(tensors: dict[str, torch.Tensor], threads: int = 2) -> dict[str, str]:
    """tensor_digest of every tensor, on a few threads (hashlib lets go of the GIL on large buffers)."""
    with futures.ThreadPoolExecutor(max_workers=threads) as pool:
        return dict(zip(tensors, pool.map(tensor_digest, tensors.values()), strict=True))


def file_digests(folder: Path) -> dict[str, str]:
    """tensor_digest of every tensor in folder's safetensors files, read from disk."""
    from safetensors import safe_open

    found: dict[str, str] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                found[name] = tensor_digest(f.get_tensor(name))
    return found


@contextlib.contextmanager
def rss_sampler(pid: int, period: float = 0.02) -> Iterator[list[int]]:
    """Sample the RSS of process pid every period seconds while the block runs; yields the samples list."""
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            value = rss(pid)
            if value:
                samples.append(value)
            done.wait(period)

    thread = threading.Thread(target=sample, name="rss-sampler", daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join(timeout=5)
