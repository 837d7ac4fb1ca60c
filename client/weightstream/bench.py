"""`weightstream bench`: every load path measured side by side against the transport's ceilings.

One run measures, in rounds (each round runs every path once, so the machine's noise spreads over
all of them):

- ceiling 1: a raw TCP socket transfer of the checkpoint's bytes over loopback, from a sender
  process into a preallocated buffer;
- ceiling 2: a bare gRPC server stream of the same bytes at the same message size, from a server
  process with identity serializers, each message copied into a preallocated buffer;
- baseline: safetensors.torch.load_file of every shard (page cache warm) plus load_state_dict;
- weightstream: `weightstream serve` in its own process, and the client's load_into, iter_tensors
  and load_state_dict over loopback.

Peak RSS is measured per path (Linux: VmHWM, reset through /proc/PID/clear_refs before each path),
for the client (this process) and for the server process of the path.

Peers run as `python -m weightstream.bench tcp-sender|grpc-sender ...`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from weightstream import dtypes, wire
from weightstream.demo import ParameterTree, llama_like_state_dict, save_sharded

MODEL = "bench-llama"
BARE_METHOD = "/weightstream.bench.Bare/Stream"
READY_TIMEOUT_S = 60.0
Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass
class PathResult:
    name: str
    memory: str  # how the client's destination memory was prepared
    seconds: list[float] = field(default_factory=list)
    client_peak_rss: int = 0
    server_peak_rss: int = 0
    server_rss_growth: int = 0

    def rates(self, total: int) -> list[float]:
        return sorted(total / s / 1e9 for s in self.seconds)

    def median_rate(self, total: int) -> float:
        return total / statistics.median(self.seconds) / 1e9


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
    """Total bytes and tensor shapes of an existing checkpoint folder (headers only)."""
    import json as _json
    import struct

    shapes: Shapes = {}
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = _json.loads(f.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = dtypes.BY_SAFETENSORS[entry["dtype"]]
            shape = tuple(entry["shape"])
            shapes[name] = (shape, dtype.torch)
            total += wire.numel(shape) * dtype.itemsize
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
# Peers in their own processes


def _peer_command(kind: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "weightstream.bench", kind, *args]


@contextlib.contextmanager
def _process(
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


def serve_weightstream(
    root: Path | None, chunk_bytes: int, extra_args: Sequence[str] = ()
) -> contextlib.AbstractContextManager[tuple[subprocess.Popen[str], int]]:
    """`weightstream serve` in its own process on a free port (other settings from extra_args, then WEIGHTSTREAM_*)."""
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
        "--chunk-bytes",
        str(chunk_bytes),
        "--log-level",
        "INFO",
    ]
    if root is not None:
        command += ["--model-root", str(root)]
    return _process([*command, *extra_args], "grpc_port")


def _tcp_sender(port: int, paths: Sequence[str], chunk_bytes: int) -> None:
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buffer):
                    sock.sendall(view[:n])


def _grpc_sender(paths: Sequence[str], chunk_bytes: int) -> None:
    import grpc

    from weightstream.allocator import tune_malloc

    tune_malloc()

    def stream(_request: bytes, _context: grpc.ServicerContext) -> Iterator[bytes]:
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                while data := f.read(chunk_bytes):
                    yield data

    handler = grpc.method_handlers_generic_handler(
        "weightstream.bench.Bare",
        {"Stream": grpc.unary_stream_rpc_method_handler(stream, request_deserializer=None, response_serializer=None)},
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.max_send_message_length", wire.MAX_MESSAGE_BYTES)]
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"bare_grpc_port={port}", file=sys.stderr, flush=True)
    server.wait_for_termination()


# ---------------------------------------------------------------------------------------------
# The paths


def _touched_buffer(total: int) -> torch.Tensor:
    buffer = torch.empty(total, dtype=torch.uint8)
    buffer.zero_()  # touch every page now, outside the timed part
    return buffer


def run_tcp(paths: Sequence[str], buffer: torch.Tensor, chunk_bytes: int) -> float:
    total = buffer.numel()
    view = memoryview(buffer.numpy())  # type: ignore[arg-type]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        proc = subprocess.Popen(_peer_command("tcp-sender", str(port), str(chunk_bytes), *paths))
        try:
            listener.settimeout(READY_TIMEOUT_S)
            conn, _ = listener.accept()
            with conn:
                started = time.perf_counter()
                received = 0
                while received < total:
                    n = conn.recv_into(view[received:], min(total - received, 1 << 22))
                    if n == 0:
                        raise RuntimeError(f"TCP sender closed after {received} of {total} bytes")
                    received += n
                seconds = time.perf_counter() - started
        finally:
            proc.wait(timeout=60)
    return seconds


def run_bare_grpc(port: int, buffer: torch.Tensor) -> float:
    import grpc

    base = buffer.data_ptr()
    with grpc.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES)]
    ) as channel:
        call: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
            BARE_METHOD, request_serializer=None, response_deserializer=None
        )
        started = time.perf_counter()
        offset = 0
        for message in call(b""):
            ctypes.memmove(base + offset, message, len(message))  # the same one copy load_into makes
            offset += len(message)
        seconds = time.perf_counter() - started
    if offset != buffer.numel():
        raise RuntimeError(f"bare gRPC stream sent {offset} of {buffer.numel()} bytes")
    return seconds


def run_safetensors(paths: Sequence[str], module: torch.nn.Module) -> float:
    from safetensors.torch import load_file

    started = time.perf_counter()
    loaded: dict[str, torch.Tensor] = {}
    for path in paths:
        loaded.update(load_file(path))
    module.load_state_dict(loaded)
    return time.perf_counter() - started


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


# ---------------------------------------------------------------------------------------------
# The command


@dataclass
class BenchReport:
    total_bytes: int
    tensors: int
    chunk_bytes: int
    runs: int
    streams: int
    paths: list[PathResult]

    def by_name(self, name: str) -> PathResult:
        return next(p for p in self.paths if p.name == name)


CEILING_TCP = "ceiling 1: raw TCP socket"
CEILING_GRPC = "ceiling 2: bare gRPC stream"
BASELINE = "baseline: safetensors load_file + load_state_dict"
LOAD_INTO = "weightstream load_into"
ITER_TENSORS = "weightstream iter_tensors"
LOAD_STATE_DICT = "weightstream load_state_dict"


def run_bench(*, gb: float, runs: int, chunk_bytes: int, checkpoint: Path | None, streams: int = 1) -> BenchReport:
    from weightstream.allocator import tune_malloc
    from weightstream.client import WeightStreamClient

    tune_malloc()  # the client side of every path, as the servers and senders do for theirs

    with tempfile.TemporaryDirectory(prefix="weightstream-bench-") as tmp:
        if checkpoint is None:
            root = Path(tmp)
            total, shapes = write_checkpoint(root / MODEL, gb)
            model = MODEL
        else:
            root, model = checkpoint.parent, checkpoint.name
            total, shapes = read_shapes(checkpoint)
        paths = [str(p) for p in sorted((root / model).glob("*.safetensors"))]
        file_bytes = sum(os.path.getsize(p) for p in paths)
        for path in paths:  # warm the page cache, as every path below reads from it
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass
        module = ParameterTree(shapes)  # zeros: touched once, written in place by every run
        buffer = _touched_buffer(file_bytes)
        results = {
            CEILING_TCP: PathResult(CEILING_TCP, "preallocated, touched"),
            CEILING_GRPC: PathResult(CEILING_GRPC, "preallocated, touched"),
            BASELINE: PathResult(BASELINE, "safetensors allocates; copied into touched parameters"),
            LOAD_INTO: PathResult(LOAD_INTO, "the module's parameters, touched"),
            ITER_TENSORS: PathResult(ITER_TENSORS, "fresh per tensor, dropped once yielded"),
            LOAD_STATE_DICT: PathResult(LOAD_STATE_DICT, "fresh per tensor, all kept"),
        }
        with (
            _process(_peer_command("grpc-sender", str(chunk_bytes), *paths), "bare_grpc_port") as (bare, bare_port),
            serve_weightstream(root, chunk_bytes) as (server, port),
            WeightStreamClient(f"127.0.0.1:{port}", chunk_bytes=chunk_bytes, progress=False, streams=streams) as client,
        ):
            client.load_into(module, model)  # warm: streamer threads, channel, allocator
            run_bare_grpc(bare_port, buffer)

            def measure(name: str, action: Callable[[], float], server_pid: int | None) -> None:
                reset_peak_rss()
                client_before = rss()
                if server_pid is not None:
                    reset_peak_rss(server_pid)
                    server_before = rss(server_pid)
                result = results[name]
                result.seconds.append(action())
                result.client_peak_rss = max(result.client_peak_rss, peak_rss() - client_before)
                if server_pid is not None:
                    result.server_peak_rss = max(result.server_peak_rss, peak_rss(server_pid))
                    result.server_rss_growth = max(result.server_rss_growth, peak_rss(server_pid) - server_before)

            for _ in range(runs):
                measure(CEILING_TCP, lambda: run_tcp(paths, buffer, chunk_bytes), None)
                measure(CEILING_GRPC, lambda: run_bare_grpc(bare_port, buffer), bare.pid)
                measure(BASELINE, lambda: run_safetensors(paths, module), None)
                measure(LOAD_INTO, lambda: _timed(lambda: client.load_into(module, model)), server.pid)
                measure(ITER_TENSORS, lambda: _timed(lambda: sum(1 for _ in client.iter_tensors(model))), server.pid)
                measure(LOAD_STATE_DICT, lambda: _timed(lambda: client.load_state_dict(model)), server.pid)
    return BenchReport(total, len(shapes), chunk_bytes, runs, streams, list(results.values()))


def format_report(report: BenchReport) -> str:
    total = report.total_bytes
    tcp = report.by_name(CEILING_TCP).median_rate(total)
    bare = report.by_name(CEILING_GRPC).median_rate(total)
    lines = [
        f"checkpoint: {total / 1e9:.2f} GB, {report.tensors} tensors; chunks of {report.chunk_bytes // 1024} KiB; "
        f"{report.streams} stream(s) per weightstream load; "
        f"{report.runs} runs of every path, interleaved; servers and senders in their own processes on 127.0.0.1; "
        "glibc malloc tuned in every process (weightstream.allocator)",
        "",
        "| path | median GB/s | min..max GB/s | vs ceiling 1 | vs ceiling 2 | client peak RSS | server peak RSS"
        " (growth) | destination memory |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in report.paths:
        rates = result.rates(total)
        median = result.median_rate(total)
        server = (
            f"{result.server_peak_rss / 2**20:.0f} MiB (+{result.server_rss_growth / 2**20:.0f})"
            if result.server_peak_rss
            else "-"
        )
        lines.append(
            f"| {result.name} | {median:.2f} | {rates[0]:.2f}..{rates[-1]:.2f} | {median / tcp:.2f}x | "
            f"{median / bare:.2f}x | +{result.client_peak_rss / 2**20:.0f} MiB | {server} | {result.memory} |"
        )
    load_into = report.by_name(LOAD_INTO)
    rate = load_into.median_rate(total)
    growth = load_into.server_rss_growth
    lines += [
        "",
        f"target load_into >= 0.9x ceiling 2:  {rate / bare:.2f}x  {_verdict(rate >= 0.9 * bare)}",
        f"target load_into >= 0.35x ceiling 1: {rate / tcp:.2f}x  {_verdict(rate >= 0.35 * tcp)}",
        f"server RSS growth while streaming (load_into): {growth / 2**20:.0f} MiB "
        f"({'within' if growth <= 512 * 2**20 else 'over'} 512 MiB)",
        "peak RSS columns: growth of the client's peak over its RSS just before the path (the module and the"
        " ceilings' buffer were allocated and touched before any path), and the server process's peak (growth)",
    ]
    return "\n".join(lines)


def _verdict(reached: bool) -> str:
    return "reached" if reached else "not reached"


def plot_report(report: BenchReport, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib: pip install 'weightstream[plot]' ({exc})") from exc
    total = report.total_bytes
    measured = [p for p in report.paths if p.name not in (CEILING_TCP, CEILING_GRPC)]
    figure, axes = plt.subplots(figsize=(9, 4.5))
    names = [p.name.replace("weightstream ", "").replace("baseline: ", "") for p in measured]
    medians = [p.median_rate(total) for p in measured]
    low = [m - p.rates(total)[0] for m, p in zip(medians, measured, strict=True)]
    high = [p.rates(total)[-1] - m for m, p in zip(medians, measured, strict=True)]
    axes.bar(names, medians, yerr=[low, high], capsize=4, color="#4477aa")
    for ceiling, style in ((CEILING_TCP, "--"), (CEILING_GRPC, ":")):
        axes.axhline(report.by_name(ceiling).median_rate(total), linestyle=style, color="#cc3311", label=ceiling)
    axes.set_ylabel("GB/s (median, min..max)")
    axes.set_title(f"weightstream bench: {total / 1e9:.2f} GB over loopback")
    axes.legend(loc="upper right", fontsize="small")
    plt.setp(axes.get_xticklabels(), rotation=15, ha="right", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def run_and_print(
    gb: float,
    runs: int,
    chunk_bytes: int,
    checkpoint: Path | None,
    json_path: Path | None,
    plot_path: Path | None,
    streams: int = 1,
) -> int:
    report = run_bench(gb=gb, runs=runs, chunk_bytes=chunk_bytes, checkpoint=checkpoint, streams=streams)
    print(format_report(report))
    if json_path is not None:
        json_path.write_text(json.dumps(asdict(report), indent=2))
        print(f"raw figures: {json_path}")
    if plot_path is not None:
        plot_report(report, plot_path)
        print(f"plot: {plot_path}")
    return 0


if __name__ == "__main__":
    kind, *rest = sys.argv[1:]
    if kind == "tcp-sender":
        _tcp_sender(int(rest[0]), rest[2:], int(rest[1]))
    elif kind == "grpc-sender":
        _grpc_sender(rest[1:], int(rest[0]))
    else:
        raise SystemExit(f"unknown peer {kind!r}")
