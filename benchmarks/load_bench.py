"""The load benchmark: every load path measured side by side against the network's ceiling.

One run measures, in rounds (each round runs every path once, so the machine's noise spreads over
all of them), up to three tables:

- page cache: the checkpoint's files warm in the page cache, every server reading them from there:
  - the ceiling: a sender process that os.sendfile()s the files' bytes from the page cache to a
    loopback TCP socket, a chunk per call (the data port's sends without their frames), received
    by recv_into (MSG_WAITALL, a chunk per call) into a preallocated, touched buffer: one kernel
    copy per byte and no user-space copy, the least work a load over a socket can do;
  - a bare gRPC server stream of the same bytes at the same message size (a server process with
    identity serializers, each message copied into a preallocated buffer): a reference for the
    grpc transport, not a ceiling (gRPC's own framing and copies cost more CPU per byte than the
    tcp transport);
  - baseline: safetensors.torch.load_file of every shard plus load_state_dict;
  - weightstream: `weightstream serve` in its own process with a data port, and the client's
    load_into over transport tcp and over grpc, iter_tensors and load_state_dict over tcp;
- server cache: load_into over tcp and grpc from a server whose --cache-bytes holds the whole
  checkpoint, filled by one load before the clock starts;
- tls: load_into over tcp and grpc from a server with --tls-cert/--tls-key (a CA and a server
  certificate made for the run; needs the cryptography package, else the table is skipped and the
  report says so).

Every row reports GB/s and CPU seconds per GB of the client (this process, every thread) and of the
server or sender process of the row, medians over runs with min..max spreads, and the ratios to the
ceiling. CPU time comes from the kernel's per-process CPU clocks (clock_gettime of
CLOCK_PROCESS_CPUTIME_ID here, clock_getcpuclockid(pid) for the server), which count every thread,
exited ones included, to the nanosecond; /proc/PID/stat's utime+stime (clock ticks) where a peer's
clock cannot be read. Over loopback the kernel's TCP work for a byte is charged to whichever end
happens to run it (a receiver's ACK may push the sender's queued bytes), so the split between
client and server CPU moves with timing; their sum is the steadier figure, and the report gives it
for load_into over tcp. Peak RSS is measured per path (Linux: VmHWM, reset through
/proc/PID/clear_refs before each path), for the client and for the server process of the path.

Every server gets a free data port of its own, never the default 50052. Peers run as
`python benchmarks/load_bench.py tcp-sender|grpc-sender ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import select
import socket
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    READY_TIMEOUT_S,
    TlsFiles,
    _timed,
    peak_rss,
    process_cpu_seconds,
    read_shapes,
    reset_peak_rss,
    rss,
    run_process,
    self_cpu_seconds,
    serve_weightstream,
    write_checkpoint,
    write_tls_files,
)
from weightstream.allocator import tune_malloc
from weightstream.demo import ParameterTree
from weightstream.protocol import wire

if TYPE_CHECKING:
    from weightstream.client import WeightStreamClient

MODEL = "bench-llama"
# The sendfile sender exits when no connection comes for this long (the bench that started it died).
SENDER_IDLE_S = 600.0
# A transfer that moves no byte for this long has failed (both ends of the ceiling give up).
STALL_S = 60
BARE_METHOD = "/weightstream.bench.Bare/Stream"
PAGE_CACHE = "page cache"
SERVER_CACHE = "server cache"
TLS = "tls"
TABLES = (PAGE_CACHE, SERVER_CACHE, TLS)
TABLE_TITLES = {
    PAGE_CACHE: "from the page cache (warm), plain TCP",
    SERVER_CACHE: "from the server's RAM cache (--cache-bytes, filled by one load first), plain TCP",
    TLS: "over TLS (server --tls-cert/--tls-key, client tls=True), from the page cache",
}

CEILING = "ceiling: raw TCP, sendfile -> recv_into"
BARE_GRPC = "bare gRPC stream (identity serializers)"
BASELINE = "baseline: safetensors load_file + load_state_dict"
LOAD_INTO_TCP = "weightstream load_into, tcp"
LOAD_INTO_GRPC = "weightstream load_into, grpc"
ITER_TENSORS = "weightstream iter_tensors, tcp"
LOAD_STATE_DICT = "weightstream load_state_dict, tcp"
CACHE_TCP = "weightstream load_into, tcp, server cache"
CACHE_GRPC = "weightstream load_into, grpc, server cache"
TLS_TCP = "weightstream load_into, tcp + TLS"
TLS_GRPC = "weightstream load_into, grpc + TLS"

# Targets: the tcp transport against the ceiling, and TLS on the data connection against TLS in gRPC.
TARGET_TCP_RATE = 0.8
TARGET_TCP_CLIENT_CPU = 1.3
TARGET_TCP_SERVER_CPU = 2.0
TARGET_TLS_TCP_OVER_GRPC = 2.0
TARGET_GRPC_OVER_BARE = 0.9


@dataclass
class PathResult:
    name: str
    table: str
    memory: str  # how the client's destination memory was prepared
    seconds: list[float] = field(default_factory=list)
    # CPU seconds per run: this process (every thread), and the row's server or sender process
    # (empty where the row has none).
    client_cpu: list[float] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)
    transport: str = ""  # what weightstream reported it used; empty for the other rows
    client_peak_rss: int = 0
    server_peak_rss: int = 0
    server_rss_growth: int = 0

    def rates(self, total: int) -> list[float]:
        return sorted(total / s / 1e9 for s in self.seconds)

    def median_rate(self, total: int) -> float:
        return total / statistics.median(self.seconds) / 1e9

    def client_cpu_per_gb(self, total: int) -> list[float]:
        return sorted(c / (total / 1e9) for c in self.client_cpu)

    def server_cpu_per_gb(self, total: int) -> list[float]:
        return sorted(c / (total / 1e9) for c in self.server_cpu)


def _peer_command(kind: str, *args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), kind, *args]


def _sendfile_sender(paths: Sequence[str], chunk_bytes: int) -> None:
    """Send every connection all of paths' bytes with os.sendfile, until none comes for SENDER_IDLE_S.

    The server's data connections without their framing: TCP_NODELAY, a non-blocking socket with
    poll() when it is full, one os.sendfile call per chunk_bytes.
    """
    files = [os.open(path, os.O_RDONLY) for path in paths]
    sizes = [os.fstat(fd).st_size for fd in files]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(SENDER_IDLE_S)
        print(f"tcp_sender_port={listener.getsockname()[1]}", file=sys.stderr, flush=True)
        while True:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                return
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(STALL_S)
                out = conn.fileno()
                writable = select.poll()
                writable.register(out, select.POLLOUT)
                for fd, size, path in zip(files, sizes, paths, strict=True):
                    done = 0
                    while done < size:
                        try:
                            n = os.sendfile(out, fd, done, min(size - done, chunk_bytes))
                        except BlockingIOError:
                            if not writable.poll(STALL_S * 1000):
                                raise TimeoutError(f"the bench took no byte for {STALL_S} s") from None
                            continue
                        if n == 0:
                            raise RuntimeError(f"{path} ended at byte {done} of {size}")
                        done += n


def _grpc_sender(paths: Sequence[str], chunk_bytes: int) -> None:
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


def run_sendfile_ceiling(port: int, buffer: torch.Tensor, chunk_bytes: int) -> float:
    """Receive the sendfile sender's bytes into buffer, chunk_bytes per recv_into; seconds to the last byte."""
    total = buffer.numel()
    view = memoryview(buffer.numpy())  # type: ignore[arg-type]
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=READY_TIMEOUT_S) as conn:
        # Blocking, as the tcp transport's receives are; SO_RCVTIMEO bounds each one.
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", STALL_S, 0))
        received = 0
        while received < total:
            n = conn.recv_into(view[received:], min(total - received, chunk_bytes), socket.MSG_WAITALL)
            if n == 0:
                raise RuntimeError(f"the sendfile sender closed after {received} of {total} bytes")
            received += n
        seconds = time.perf_counter() - started
        if conn.recv(1):  # waits for the sender's close, so its CPU time is all counted
            raise RuntimeError(f"the sendfile sender sent more than {total} bytes")
    return seconds


def run_bare_grpc(channel: grpc.Channel, buffer: torch.Tensor) -> float:
    base = buffer.data_ptr()
    call: grpc.UnaryStreamMultiCallable[bytes, bytes] = channel.unary_stream(
        BARE_METHOD, request_serializer=None, response_deserializer=None
    )
    started = time.perf_counter()
    offset = 0
    for message in call(b"", timeout=READY_TIMEOUT_S * 10):
        ctypes.memmove(base + offset, message, len(message))  # the same one copy a gRPC load makes
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
    tables: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # tables skipped, and why

    def by_name(self, name: str) -> PathResult:
        return next(p for p in self.paths if p.name == name)

    def find(self, name: str) -> PathResult | None:
        return next((p for p in self.paths if p.name == name), None)


_Run = Callable[[], float]


@dataclass
class _Row:
    """One path of the bench: its figures, one timed run of it, and the process serving it (if any)."""

    result: PathResult
    run: _Run
    server_pid: int | None


def _measure(row: _Row) -> None:
    """One run of row, with the CPU time and peak RSS of both ends around it."""
    result, pid = row.result, row.server_pid
    reset_peak_rss()
    client_before = rss()
    server_before, server_cpu = 0, 0.0
    if pid is not None:
        reset_peak_rss(pid)
        server_before = rss(pid)
        server_cpu = process_cpu_seconds(pid)
    client_cpu = self_cpu_seconds()
    result.seconds.append(row.run())
    result.client_cpu.append(self_cpu_seconds() - client_cpu)
    result.client_peak_rss = max(result.client_peak_rss, peak_rss() - client_before)
    if pid is not None:
        result.server_cpu.append(process_cpu_seconds(pid) - server_cpu)
        result.server_peak_rss = max(result.server_peak_rss, peak_rss(pid))
        result.server_rss_growth = max(result.server_rss_growth, peak_rss(pid) - server_before)


def _load_into_run(
    client: WeightStreamClient, module: torch.nn.Module, model: str, result: PathResult, expected: str
) -> _Run:
    """A timed load_into of model into module that checks the load went over transport expected."""

    def run() -> float:
        started = time.perf_counter()
        report = client.load_into(module, model)
        seconds = time.perf_counter() - started
        if report.transport != expected:
            raise RuntimeError(f"{result.name}: the load went over {report.transport}, not {expected}")
        result.transport = report.transport
        return seconds

    return run


def _iter_tensors_run(client: WeightStreamClient, model: str) -> _Run:
    """A timed iter_tensors of model, each tensor dropped once yielded."""
    return lambda: _timed(lambda: sum(1 for _ in client.iter_tensors(model)))


def _state_dict_run(client: WeightStreamClient, model: str) -> _Run:
    """A timed load_state_dict of model."""
    return lambda: _timed(lambda: client.load_state_dict(model))


def run_bench(
    *,
    gb: float,
    runs: int,
    chunk_bytes: int,
    checkpoint: Path | None,
    streams: int = 1,
    tables: Sequence[str] = TABLES,
) -> BenchReport:
    """Measure the paths of tables (TABLES: page cache, server cache, tls) runs times each, interleaved."""
    from weightstream.allocator import tune_malloc
    from weightstream.client import WeightStreamClient

    unknown = sorted(set(tables) - set(TABLES))
    if unknown:
        raise ValueError(f"unknown bench tables {unknown}; choose from {list(TABLES)}")
    tune_malloc()  # the client side of every path, as the servers and senders do for theirs
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="weightstream-bench-") as tmp, contextlib.ExitStack() as stack:
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
        tls_files: TlsFiles | None = None
        if TLS in tables:
            try:
                tls_files = write_tls_files(Path(tmp) / "tls")
            except ImportError as exc:
                notes.append(
                    f"TLS table skipped: making its certificates needs the cryptography package ({exc}); "
                    "pip install cryptography"
                )

        def connect(port: int, transport: str, tls: TlsFiles | None = None) -> WeightStreamClient:
            client = WeightStreamClient(
                f"127.0.0.1:{port}",
                chunk_bytes=chunk_bytes,
                progress=False,
                streams=streams,
                transport=transport,
                tls=tls is not None,
                ca_file=tls.ca if tls is not None else None,
            )
            stack.enter_context(client)
            client.load_into(module, model)  # warm: streamer threads, channel, data port, the server's cache
            return client

        def serve(*extra: str) -> tuple[int, int]:
            """A weightstream server (with a free data port) until the bench ends: its gRPC port and pid."""
            proc, port = stack.enter_context(serve_weightstream(root, chunk_bytes, extra))
            return port, proc.pid

        def load_into_rows(
            table: str, names: tuple[str, str], port: int, pid: int, tls: TlsFiles | None = None
        ) -> list[_Row]:
            """load_into over tcp and over grpc from one server, each on a client of its own."""
            made = []
            for name, transport in zip(names, ("tcp", "grpc"), strict=True):
                result = PathResult(name, table, "the module's parameters, touched")
                run = _load_into_run(connect(port, transport, tls), module, model, result, transport)
                made.append(_Row(result, run, pid))
            return made

        sender, sender_port = stack.enter_context(
            run_process(_peer_command("tcp-sender", str(chunk_bytes), *paths), "tcp_sender_port")
        )
        run_sendfile_ceiling(sender_port, buffer, chunk_bytes)  # warm
        rows = [
            _Row(
                PathResult(CEILING, PAGE_CACHE, "preallocated, touched"),
                lambda: run_sendfile_ceiling(sender_port, buffer, chunk_bytes),
                sender.pid,
            )
        ]

        if PAGE_CACHE in tables:
            bare, bare_port = stack.enter_context(
                run_process(_peer_command("grpc-sender", str(chunk_bytes), *paths), "bare_grpc_port")
            )
            channel = stack.enter_context(
                grpc.insecure_channel(
                    f"127.0.0.1:{bare_port}", options=[("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES)]
                )
            )
            run_bare_grpc(channel, buffer)  # warm
            port, pid = serve()
            streaming = connect(port, "tcp")  # for the rows that allocate their tensors
            rows += [
                _Row(
                    PathResult(BARE_GRPC, PAGE_CACHE, "preallocated, touched"),
                    lambda: run_bare_grpc(channel, buffer),
                    bare.pid,
                ),
                _Row(
                    PathResult(BASELINE, PAGE_CACHE, "safetensors allocates; copied into touched parameters"),
                    lambda: run_safetensors(paths, module),
                    None,
                ),
                *load_into_rows(PAGE_CACHE, (LOAD_INTO_TCP, LOAD_INTO_GRPC), port, pid),
                _Row(
                    PathResult(ITER_TENSORS, PAGE_CACHE, "fresh per tensor, dropped once yielded", transport="tcp"),
                    _iter_tensors_run(streaming, model),
                    pid,
                ),
                _Row(
                    PathResult(LOAD_STATE_DICT, PAGE_CACHE, "fresh per tensor, all kept", transport="tcp"),
                    _state_dict_run(streaming, model),
                    pid,
                ),
            ]

        if SERVER_CACHE in tables:
            # Room for every read unit of the checkpoint, and some: no unit is ever evicted.
            port, pid = serve("--cache-bytes", str(2 * file_bytes + (256 << 20)))
            rows += load_into_rows(SERVER_CACHE, (CACHE_TCP, CACHE_GRPC), port, pid)

        if tls_files is not None:
            port, pid = serve("--tls-cert", str(tls_files.cert), "--tls-key", str(tls_files.key))
            rows += load_into_rows(TLS, (TLS_TCP, TLS_GRPC), port, pid, tls_files)

        for _ in range(runs):
            for row in rows:
                _measure(row)
    shown = [t for t in TABLES if t in tables and (t != TLS or tls_files is not None)]
    return BenchReport(total, len(shapes), chunk_bytes, runs, streams, [r.result for r in rows], shown, notes)


def format_report(report: BenchReport) -> str:
    total = report.total_bytes
    ceiling = report.by_name(CEILING)
    ceiling_rate = ceiling.median_rate(total)
    ceiling_client = statistics.median(ceiling.client_cpu_per_gb(total))
    ceiling_server = statistics.median(ceiling.server_cpu_per_gb(total))
    lines = [
        f"checkpoint: {total / 1e9:.2f} GB, {report.tensors} tensors; chunks of {report.chunk_bytes // 1024} KiB; "
        f"{report.streams} stream(s) per weightstream load; "
        f"{report.runs} runs of every path, interleaved; servers and senders in their own processes on 127.0.0.1; "
        "glibc malloc tuned in every process (weightstream.allocator)",
    ]
    header = (
        "| path | median GB/s | min..max GB/s | vs ceiling | client CPU s/GB (min..max) | vs ceiling "
        "| server CPU s/GB (min..max) | vs ceiling | client peak RSS | server peak RSS (growth) | destination memory |"
    )
    for table in report.tables:
        rows = [ceiling, *(p for p in report.paths if p.table == table and p is not ceiling)]
        lines += ["", f"{TABLE_TITLES[table]}:", "", header, "|---" * 11 + "|"]
        for result in rows:
            rates = result.rates(total)
            median = result.median_rate(total)
            client = result.client_cpu_per_gb(total)
            server_cpu = result.server_cpu_per_gb(total)
            server_rss = (
                f"{result.server_peak_rss / 2**20:.0f} MiB (+{result.server_rss_growth / 2**20:.0f})"
                if result.server_peak_rss
                else "-"
            )
            lines.append(
                f"| {result.name} | {median:.2f} | {rates[0]:.2f}..{rates[-1]:.2f} | {median / ceiling_rate:.2f}x "
                f"| {_spread(client)} | {_times(statistics.median(client), ceiling_client)} "
                f"| {_spread(server_cpu)} "
                f"| {_times(statistics.median(server_cpu), ceiling_server) if server_cpu else '-'} "
                f"| +{result.client_peak_rss / 2**20:.0f} MiB | {server_rss} | {result.memory} |"
            )
    lines += ["", *report.notes] if report.notes else []
    lines += ["", f"targets (medians; the ceiling is the row {CEILING!r}):"]
    load_tcp = report.find(LOAD_INTO_TCP)
    if load_tcp is not None:
        lines += [
            _target(
                f"load_into tcp >= {TARGET_TCP_RATE}x the ceiling's GB/s",
                load_tcp.median_rate(total) / ceiling_rate,
                at_least=TARGET_TCP_RATE,
            ),
            _target(
                f"load_into tcp client CPU/GB <= {TARGET_TCP_CLIENT_CPU}x the ceiling's",
                _ratio(statistics.median(load_tcp.client_cpu_per_gb(total)), ceiling_client),
                at_most=TARGET_TCP_CLIENT_CPU,
            ),
            _target(
                f"load_into tcp server CPU/GB <= {TARGET_TCP_SERVER_CPU:g}x the ceiling's",
                _ratio(statistics.median(load_tcp.server_cpu_per_gb(total)), ceiling_server),
                at_most=TARGET_TCP_SERVER_CPU,
            ),
        ]
        lines.append(
            f"(not a target) load_into tcp client+server CPU/GB against the ceiling's: "
            f"{_times(_total_cpu(load_tcp, total), _total_cpu(ceiling, total))}"
        )
    tls_tcp, tls_grpc = report.find(TLS_TCP), report.find(TLS_GRPC)
    if tls_tcp is not None and tls_grpc is not None:
        lines.append(
            _target(
                f"load_into tcp+TLS >= {TARGET_TLS_TCP_OVER_GRPC:g}x the GB/s of grpc+TLS",
                tls_tcp.median_rate(total) / tls_grpc.median_rate(total),
                at_least=TARGET_TLS_TCP_OVER_GRPC,
            )
        )
    load_grpc, bare = report.find(LOAD_INTO_GRPC), report.find(BARE_GRPC)
    if load_grpc is not None and bare is not None:
        lines.append(
            _target(
                f"load_into grpc >= {TARGET_GRPC_OVER_BARE}x the bare gRPC stream's GB/s",
                load_grpc.median_rate(total) / bare.median_rate(total),
                at_least=TARGET_GRPC_OVER_BARE,
            )
        )
    lines.append("")
    for streamed in (load_tcp, load_grpc):
        if streamed is not None:
            growth = streamed.server_rss_growth
            lines.append(
                f"server RSS growth while streaming ({streamed.name}): {growth / 2**20:.0f} MiB "
                f"({'within' if growth <= 512 * 2**20 else 'over'} 512 MiB)"
            )
    lines += [
        "CPU columns: user+system CPU seconds of every thread per 10^9 tensor bytes, of the client (this process)"
        " and of the row's server or sender process (its kernel CPU clock), around each run",
        "peak RSS columns: growth of the client's peak over its RSS just before the path (the module and the"
        " ceiling's buffer were allocated and touched before any path), and the server process's peak (growth)",
    ]
    return "\n".join(lines)


def _total_cpu(result: PathResult, total: int) -> float:
    """Median over runs of client plus server CPU seconds per GB."""
    runs = [c + s for c, s in zip(result.client_cpu, result.server_cpu, strict=True)]
    return statistics.median(runs) / (total / 1e9)


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({values[0]:.3f}..{values[-1]:.3f})"


def _ratio(value: float, reference: float) -> float | None:
    return value / reference if reference > 0 else None


def _times(value: float, reference: float) -> str:
    ratio = _ratio(value, reference)
    return "-" if ratio is None else f"{ratio:.2f}x"


def _target(label: str, ratio: float | None, *, at_least: float | None = None, at_most: float | None = None) -> str:
    if ratio is None:
        return f"target {label}: not measured (the ceiling's figure is 0)"
    reached = (at_least is None or ratio >= at_least) and (at_most is None or ratio <= at_most)
    return f"target {label}: {ratio:.2f}x  {'reached' if reached else 'not reached'}"


def plot_report(report: BenchReport, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib: pip install 'weightstream[plot]' ({exc})") from exc
    total = report.total_bytes
    measured = [p for p in report.paths if p.name != CEILING]
    figure, axes = plt.subplots(figsize=(10, 5))
    names = [p.name.replace("weightstream ", "").replace("baseline: ", "") for p in measured]
    medians = [p.median_rate(total) for p in measured]
    low = [m - p.rates(total)[0] for m, p in zip(medians, measured, strict=True)]
    high = [p.rates(total)[-1] - m for m, p in zip(medians, measured, strict=True)]
    axes.bar(names, medians, yerr=[low, high], capsize=4, color="#4477aa")
    axes.axhline(report.by_name(CEILING).median_rate(total), linestyle="--", color="#cc3311", label=CEILING)
    axes.set_ylabel("GB/s (median, min..max)")
    axes.set_title(f"weightstream bench: {total / 1e9:.2f} GB over loopback")
    axes.legend(loc="upper right", fontsize="small")
    plt.setp(axes.get_xticklabels(), rotation=25, ha="right", fontsize="small")
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
    tables: Sequence[str] = TABLES,
) -> int:
    report = run_bench(gb=gb, runs=runs, chunk_bytes=chunk_bytes, checkpoint=checkpoint, streams=streams, tables=tables)
    print(format_report(report))
    if json_path is not None:
        json_path.write_text(json.dumps(asdict(report), indent=2))
        print(f"raw figures: {json_path}")
    if plot_path is not None:
        plot_report(report, plot_path)
        print(f"plot: {plot_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/load_bench.py",
        description="Generate (or take) a Llama-shaped checkpoint and load it every way, side by side: a raw TCP "
        "transfer of the same bytes (sendfile from the page cache -> recv_into the destination: the ceiling), a "
        "bare gRPC stream (a reference), safetensors load_file from the page cache (the baseline), and "
        "weightstream's load_into over the tcp transport and gRPC, iter_tensors and load_state_dict, from the "
        "page cache, from the server's RAM cache and over TLS. Prints medians, spreads, CPU seconds per GB of "
        "client and server, ratios to the ceiling and peak RSS. Needs the server's dependencies.",
    )
    parser.add_argument("--gb", type=float, default=2.0, help="size of the generated checkpoint (default 2.0)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a model folder of *.safetensors to use instead")
    parser.add_argument("--runs", type=int, default=5, help="runs of every path (default 5)")
    parser.add_argument("--chunk-bytes", type=int, default=4 * 1024 * 1024, help="message payload (default 4 MiB)")
    parser.add_argument("--streams", type=int, default=1, help="parallel streams per weightstream load (default 1)")
    parser.add_argument("--json", type=Path, default=None, help="write the raw figures to this file")
    parser.add_argument("--plot", type=Path, default=None, help="draw a bar chart to this PNG (needs matplotlib)")
    parser.add_argument(
        "--tables",
        default=",".join(TABLES),
        help="comma-separated tables to measure: page cache, server cache, tls (default: all three)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tune_malloc()
    try:
        return run_and_print(
            args.gb,
            args.runs,
            args.chunk_bytes,
            args.checkpoint,
            args.json,
            args.plot,
            streams=args.streams,
            tables=[t.strip() for t in args.tables.split(",") if t.strip()],
        )
    except ValueError as exc:
        print(f"load_bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("tcp-sender", "grpc-sender"):
        kind, chunk, *peer_paths = sys.argv[1:]
        (_sendfile_sender if kind == "tcp-sender" else _grpc_sender)(peer_paths, int(chunk))
    else:
        sys.exit(main())
