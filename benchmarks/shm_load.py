"""load_into over the shared-memory transport, over gRPC, and a bare /dev/shm read, side by side in one run.

- shm: `weightstream serve --shm-dir D` (its own process) fills a ring of slots in D; the client
  (transport="shm") copies each slot into the module's parameters;
- grpc: the same server and client over loopback gRPC (transport="grpc");
- baseline: the checkpoint's tensor bytes in one file in /dev/shm, mapped, and each tensor copied
  from the mapping into the same module's parameters (the same-host ceiling: one copy, no server).

Every path writes into the same module, whose memory was touched before the first run; rounds run
every path once each, so the machine's noise spreads over all of them. Prints medians and spreads
and the ratios the shared-memory issue targets (shm >= 2.5x gRPC, shm >= 0.5x the bare read).

Usage (from the repository root): python benchmarks/shm_load.py [--gb 1] [--runs 5] [--cache-bytes N] [--cold]
The client process and the server tune glibc malloc (weightstream.allocator), as `weightstream bench` does.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import evict_from_page_cache, serve_weightstream, write_checkpoint
from weightstream.allocator import tune_malloc
from weightstream.client import WeightStreamClient
from weightstream.protocol.shm import CHUNKS_PER_SLOT, DEFAULT_SLOTS
from weightstream.samples import ParameterTree

SHM_ROOT = Path("/dev/shm")
CHUNK_BYTES = 4 * 1024 * 1024
MODEL = "bench-llama"


def bare_read(source: Path, params: dict[str, torch.Tensor], order: list[str]) -> None:
    """Map source and copy each tensor's bytes, in file order, into its (touched) parameter."""
    with source.open("r+b") as f, mmap.mmap(f.fileno(), 0) as mapping:
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
        try:
            base = flat.data_ptr()
            offset = 0
            for name in order:
                target = params[name]
                size = target.numel() * target.element_size()
                # One copy per byte: from the mapping into the parameter, as the client's placer does.
                ctypes.memmove(target.data_ptr(), base + offset, size)
                offset += size
        finally:
            del flat


def same_bytes(source: Path, params: dict[str, torch.Tensor], order: list[str]) -> bool:
    """Whether the parameters hold exactly the bytes of source, in order."""
    data = source.read_bytes()
    offset = 0
    for name in order:
        target = params[name].reshape(-1).view(torch.uint8)
        if bytes(target.numpy()) != data[offset : offset + target.numel()]:
            return False
        offset += target.numel()
    return offset == len(data)


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def cpu_seconds(pid: int | None = None) -> float:
    """User plus system CPU seconds of this process (pid None) or of process pid, all threads."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds spent by this process and the server during each measured action, per path."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.client: dict[str, list[float]] = {}
        self.server: dict[str, list[float]] = {}

    def measure(self, path: str, action: Callable[[], float]) -> float:
        client, server = cpu_seconds(), cpu_seconds(self.server_pid)
        seconds = action()
        self.client.setdefault(path, []).append(cpu_seconds() - client)
        self.server.setdefault(path, []).append(cpu_seconds(self.server_pid) - server)
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (default 1.0)")
    parser.add_argument("--runs", type=int, default=5, help="runs per path (default 5)")
    parser.add_argument(
        "--cache-bytes", type=int, default=0, help="the server's --cache-bytes (default 0: every load reads the files)"
    )
    parser.add_argument("--streams", type=int, default=1, help="streams per load on both transports (default 1)")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="evict the checkpoint's files from the page cache (posix_fadvise DONTNEED) before each weightstream load",
    )
    args = parser.parse_args()
    tune_malloc()

    free = shutil.disk_usage(SHM_ROOT).free
    needed = int(args.gb * 1e9) + DEFAULT_SLOTS * CHUNKS_PER_SLOT * CHUNK_BYTES + (256 << 20)
    if free < needed:
        raise SystemExit(f"{SHM_ROOT} has {free / 1e9:.2f} GB free; this benchmark needs about {needed / 1e9:.2f} GB")

    with (
        tempfile.TemporaryDirectory(prefix="weightstream-shm-bench-") as tmp,
        tempfile.TemporaryDirectory(prefix="weightstream-shm-bench-", dir=SHM_ROOT) as shm_tmp,
    ):
        work, shm_dir = Path(tmp), Path(shm_tmp)
        total, shapes = write_checkpoint(work / MODEL, args.gb)
        module = ParameterTree(shapes)
        params = {name: p.data for name, p in module.named_parameters()}
        # The baseline's source: every tensor's bytes back to back in one /dev/shm file.
        order = sorted(shapes)
        source = SHM_ROOT / f"{shm_dir.name}-baseline.bin"
        try:
            state: dict[str, torch.Tensor] = {}
            for shard in sorted((work / MODEL).glob("*.safetensors")):
                state.update(load_file(str(shard)))
            with source.open("wb") as f:
                for name in order:
                    f.write(memoryview(state[name].reshape(-1).view(torch.uint8).numpy()))
            del state
            torch.manual_seed(0)
            for p in params.values():
                p.view(torch.uint8).random_()  # the bytes the loads must overwrite; touches every page
            results: dict[str, list[float]] = {"bare /dev/shm mmap read": [], "weightstream shm": [],
                                                "weightstream grpc": []}  # fmt: skip
            os.environ["WEIGHTSTREAM_SHM_DIR"] = str(shm_dir)
            os.environ["WEIGHTSTREAM_CACHE_BYTES"] = str(args.cache_bytes)
            transports: list[str] = []
            try:
                with (
                    serve_weightstream(work, CHUNK_BYTES) as (server, port),
                    WeightStreamClient(
                        f"127.0.0.1:{port}", progress=False, transport="shm", shm_dir=shm_dir, streams=args.streams
                    ) as shm,
                    WeightStreamClient(
                        f"127.0.0.1:{port}", progress=False, transport="grpc", streams=args.streams
                    ) as grpc_client,
                ):
                    # Warm the page cache, the server's streamer and both channels.
                    shm.load_into(module, MODEL)
                    grpc_client.load_into(module, MODEL)
                    meter = CpuMeter(server.pid)

                    def load(client: WeightStreamClient) -> float:
                        if args.cold:
                            for shard in (work / MODEL).glob("*.safetensors"):
                                evict_from_page_cache(shard)
                        report = client.load_into(module, MODEL)
                        transports.append(report.transport)
                        return report.seconds

                    for _ in range(args.runs):
                        for path, action in (
                            ("bare /dev/shm mmap read", lambda: timed(lambda: bare_read(source, params, order))),
                            ("weightstream shm", lambda: load(shm)),
                            ("weightstream grpc", lambda: load(grpc_client)),
                        ):
                            results[path].append(meter.measure(path, action))
                    leftovers = sorted(os.listdir(shm_dir))
                    for p in params.values():
                        p.view(torch.uint8).random_()
                    shm.load_into(module, MODEL)
                    exact = same_bytes(source, params, order)
            finally:
                del os.environ["WEIGHTSTREAM_SHM_DIR"], os.environ["WEIGHTSTREAM_CACHE_BYTES"]
        finally:
            source.unlink(missing_ok=True)

    medians = {name: statistics.median(times) for name, times in results.items()}
    print(
        f"checkpoint: {total / 1e9:.2f} GB bfloat16, {len(shapes)} tensors, 4 shards; chunk {CHUNK_BYTES >> 20} MiB, "
        f"ring {DEFAULT_SLOTS} x {CHUNKS_PER_SLOT * CHUNK_BYTES >> 20} MiB; {args.runs} runs each, medians; "
        f"{os.cpu_count()} CPUs; server cache {args.cache_bytes / 1e9:.1f} GB; {args.streams} stream(s) per load; "
        f"page cache {'evicted before each load' if args.cold else 'warm'}"
    )
    print(
        f"transports reported: {sorted(set(transports))}; segments left in the shm dir: {len(leftovers)}; "
        f"shm load bit-exact: {exact}"
    )
    print()
    print("| path | median s | median GB/s | min..max GB/s | client CPU s/GB | server CPU s/GB |")
    print("|---|---|---|---|---|---|")
    for name, times in results.items():
        rates = sorted(total / t / 1e9 for t in times)
        client_cpu = statistics.median(meter.client[name]) / (total / 1e9)
        server_cpu = statistics.median(meter.server[name]) / (total / 1e9)
        print(
            f"| {name} | {medians[name]:.3f} | {total / medians[name] / 1e9:.2f} | {rates[0]:.2f}..{rates[-1]:.2f} "
            f"| {client_cpu:.3f} | {server_cpu:.3f} |"
        )
    print()
    shm_rate = total / medians["weightstream shm"]
    grpc_rate = total / medians["weightstream grpc"]
    bare_rate = total / medians["bare /dev/shm mmap read"]
    print(f"shm / gRPC:      {shm_rate / grpc_rate:.2f}x (target >= 2.5)")
    print(f"shm / bare read: {shm_rate / bare_rate:.2f}x (target >= 0.5)")
    if not exact or leftovers:
        raise SystemExit("the shared-memory load was not bit-exact, or left segments behind")


if __name__ == "__main__":
    main()
