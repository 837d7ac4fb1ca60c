"""Invalid headers, measured: a `weightstream serve` process's memory and time for manifests of a huge bad header.

The model's one file has a header of about --mb MB of valid JSON (tensors with long names) and one
tensor whose dtype is no dtype, so the header fails only once it is parsed whole. Each run starts
a fresh server that is asked GetManifest once, and another asked from 4 clients at once, then from
4 again; each step reports the server's peak RSS growth over its RSS before the step (VmHWM, reset through
/proc/PID/clear_refs) and its wall time. Without parse-once every request parses the header (4
concurrent parses hold 4 parsed copies); with it, one parse serves every request of that file
version, and a repeated request costs a stat.

Usage (from the repository root): python benchmarks/header_parse.py [--mb 95] [--runs 3]
[--server-pythonpath DIR:DIR] (to measure another checkout's server, for a before/after).
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import peak_rss, reset_peak_rss, rss, serve_weightstream
from weightstream.protocol import wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

MODEL = "bad-header"
MIB = 1024 * 1024


def write_bad_header(folder: Path, mb: float) -> int:
    """model.safetensors with a header of about mb MB that fails on its last tensor; returns the header's bytes."""
    name_chars = 300
    entry_bytes = name_chars + 70
    count = int(mb * 1e6 / entry_bytes)
    header = {
        f"{i:08d}{'n' * (name_chars - 8)}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
        for i in range(count)
    }
    header["broken"] = {"dtype": "NOPE", "shape": [1], "data_offsets": [4 * count, 4 * count + 4]}
    body = json.dumps(header, separators=(",", ":")).encode()
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "model.safetensors").open("wb") as f:
        f.write(struct.pack("<Q", len(body)))
        f.write(body)
        f.write(bytes(4 * count + 4))
    return len(body)


def manifest(stub: pb_grpc.WeightStreamServiceStub) -> grpc.StatusCode:
    try:
        stub.GetManifest(pb.GetManifestRequest(model=MODEL), timeout=600)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def step(pid: int, stub: pb_grpc.WeightStreamServiceStub, callers: int) -> tuple[float, float]:
    """(peak RSS growth in MiB, seconds) of callers concurrent GetManifest calls, each checked to be DATA_LOSS."""
    before = rss(pid)
    reset_peak_rss(pid)
    started = time.perf_counter()
    with futures.ThreadPoolExecutor(callers) as pool:
        codes = list(pool.map(lambda _: manifest(stub), range(callers)))
    seconds = time.perf_counter() - started
    if codes != [grpc.StatusCode.DATA_LOSS] * callers:
        raise RuntimeError(f"expected DATA_LOSS for every call, got {codes}")
    return (peak_rss(pid) - before) / MIB, seconds


def main() -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/header_parse.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=95.0, help="header size in MB (default 95)")
    parser.add_argument("--runs", type=int, default=3, help="fresh servers to measure (default 3)")
    parser.add_argument("--server-pythonpath", default=None, help="PYTHONPATH of the server process")
    args = parser.parse_args()
    steps = ("1 request", "4 at once", "4 at once, again")
    figures: dict[str, list[tuple[float, float]]] = {s: [] for s in steps}
    with tempfile.TemporaryDirectory(prefix="weightstream-header-") as tmp:
        root = Path(tmp)
        header_bytes = write_bad_header(root / MODEL, args.mb)
        for _ in range(args.runs):
            # A fresh server for 1 request, and another for 4 at once (then 4 more): no step warms the next.
            for first, callers in ((steps[0], 1), (steps[1], 4)):
                with serve_weightstream(root, wire.DEFAULT_CHUNK_BYTES, pythonpath=args.server_pythonpath) as (
                    proc,
                    port,
                ):
                    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                        stub = pb_grpc.WeightStreamServiceStub(channel)
                        figures[first].append(step(proc.pid, stub, callers))
                        if callers == 4:
                            figures[steps[2]].append(step(proc.pid, stub, 4))
    print(f"header: {header_bytes / 1e6:.1f} MB of JSON, invalid on its last tensor; {args.runs} fresh servers")
    print("| step | server peak RSS growth MiB, median (min..max) | seconds, median (min..max) |")
    print("|---|---|---|")
    for name in steps:
        mib = [f[0] for f in figures[name]]
        sec = [f[1] for f in figures[name]]
        print(
            f"| {name} | {statistics.median(mib):.0f} ({min(mib):.0f}..{max(mib):.0f}) | "
            f"{statistics.median(sec):.3f} ({min(sec):.3f}..{max(sec):.3f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
