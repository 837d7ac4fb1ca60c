"""What the benchmarks share: checkpoints to measure, memory and CPU clocks, servers and peers in processes, TLS files.

Every benchmark under benchmarks/ and the tests that measure memory import this module; nothing of it
is installed with the client. Each helper is for Linux (it reads /proc) and starts its processes
on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from weightstream.samples import llama_like_state_dict, save_sharded

if TYPE_CHECKING:
    pass

READY_TIMEOUT_S = 60.0

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


# ---------------------------------------------------------------------------------------------
# The checkpoint


def write_checkpoint(folder: Path, gb: float) -> tuple[int, Shapes]:
    """A Llama-shaped bfloat16 checkpoint of about gb GB in 4 shards; returns its bytes and shapes."""
    hidden, intermediate, vocab = 2048, 5632, 32000
    layer_bytes = 2 * (4 * hidden * hidden + 3 * hidden * intermediate)
    layers = max(1, round((gb * 1e9 - 2 * 2 * vocab * hidden) / layer_bytes))
    state = llama_like_state_dict(layers=layers, hidden=hidden, intermediate=intermediate, vocab=vocab)
    save_sharded(state, folder, shards=4)
    return sum(t.numel() * t.element_size() for t in state.values()), {
        n: (tuple(t.shape), t.dtype) for n, t in state.items()
    }


def read_shapes(folder: Path) -> tuple[int, Shapes]:
    """Total bytes and tensor shapes of an existing checkpoint folder (headers only, read as the server reads them)."""
    from weightstream_server.storage.header import read_header

    shapes: Shapes = {}
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:

            def read_range(start: int, length: int, f: BinaryIO = f) -> bytes:
                f.seek(start)
                return f.read(length)

            for tensor in read_header(read_range, path.stat().st_size, str(path)):
                shapes[tensor.name] = (tensor.shape, tensor.dtype.torch)
                total += tensor.end - tensor.start
    return total, shapes


# ---------------------------------------------------------------------------------------------
# Memory measurement (Linux)


def evict_from_page_cache(path: Path) -> None:
    """Drop path's pages from the page cache (clean pages go without privileges), so the next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def peak_rss(pid: int | str = "self") -> int:
    """Peak resident set size of a process in bytes (VmHWM), 0 where /proc does not say."""
    return _status_bytes(pid, "VmHWM:")


def rss(pid: int | str = "self") -> int:
    """Resident set size of a process in bytes (VmRSS), 0 where /proc does not say."""
    return _status_bytes(pid, "VmRSS:")


def _status_bytes(pid: int | str, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_rss(pid: int | str = "self") -> None:
    """Make VmHWM start again from the current RSS (writing 5 to clear_refs, Linux 4.0 and later)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


# ---------------------------------------------------------------------------------------------
# CPU time


def self_cpu_seconds() -> float:
    """User plus system CPU seconds of this process, every thread (gRPC's included), to the nanosecond."""
    return time.clock_gettime(time.CLOCK_PROCESS_CPUTIME_ID)


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process pid, every thread, exited ones included.

    From its CPU clock (clock_getcpuclockid) where libc offers it; else /proc/PID/stat's utime+stime,
    in clock ticks (SC_CLK_TCK, 1/100 s on most systems).
    """
    clock = _cpu_clock(pid)
    if clock is not None:
        with contextlib.suppress(OSError):
            return time.clock_gettime(clock)
    # The command may hold ")" and spaces: the fields are counted after its last ")", from field 3.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_clock(pid: int) -> int | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        clock = ctypes.c_int()
        if libc.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0:
            return clock.value
    except (OSError, AttributeError):
        pass
    return None


# ---------------------------------------------------------------------------------------------
# Peers in their own processes


@contextlib.contextmanager
def run_process(
    command: list[str], ready: str, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Start command; wait for `<ready>=PORT` on its stderr; yield the process and that port."""
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
    found: list[int] = []
    event = threading.Event()
    pattern = re.compile(rf"{ready}=(\d+)")

    def watch() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            match = pattern.search(line)
            if match and not found:
                found.append(int(match.group(1)))
                event.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        if not event.wait(READY_TIMEOUT_S):
            raise RuntimeError(
                f"{command[3] if len(command) > 3 else command[0]} did not start within {READY_TIMEOUT_S} s"
            )
        yield proc, found[0]
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen[str] | subprocess.Popen[bytes]) -> None:
    """SIGTERM proc and wait for it (a server drains); SIGKILL it after 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (free until someone else binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def serve_weightstream(
    root: Path | None,
    chunk_bytes: int,
    extra_args: Sequence[str] = (),
    *,
    data_port: int | None = None,
    pythonpath: str | None = None,
) -> contextlib.AbstractContextManager[tuple[subprocess.Popen[str], int]]:
    """`weightstream serve` in its own process on a free gRPC port.

    data_port: None gives the server a free data port (never the default 50052, which another
    server may hold), 0 turns it off. Other settings come from extra_args (which win over these),
    then WEIGHTSTREAM_*. pythonpath: the server's PYTHONPATH (another checkout, for a before/after).
    """
    command = [
        sys.executable,
        "-m",
        "weightstream",
        "serve",
        "--host",
        "127.0.0.1",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--data-port",
        str(free_port() if data_port is None else data_port),
        "--chunk-bytes",
        str(chunk_bytes),
        "--log-level",
        "INFO",
    ]
    if root is not None:
        command += ["--model-root", str(root)]
    env = None if pythonpath is None else {**os.environ, "PYTHONPATH": pythonpath}
    return run_process([*command, *extra_args], "grpc_port", env=env)


# ---------------------------------------------------------------------------------------------
# TLS files


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a CA and of a server certificate it signed for 127.0.0.1 and localhost."""

    ca: Path
    cert: Path
    key: Path


def write_tls_files(folder: Path) -> TlsFiles:
    """A fresh CA and a server certificate for 127.0.0.1, valid for a day; ImportError without cryptography."""
    from tests.support.certificates import make_pki

    pki = make_pki(folder, "bench")
    return TlsFiles(pki.ca, pki.server_cert, pki.server_key)


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def reset_module(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put state (by name) back into module's parameters."""
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            parameter.copy_(state[name])


def check_module(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Exit naming the first parameter of module whose bytes are not state's (2-byte dtypes)."""
    for name, parameter in module.named_parameters():
        if not torch.equal(parameter.detach().cpu().view(torch.int16), state[name].view(torch.int16)):
            raise SystemExit(f"{name}: not bit-exact after the update")
