"""Open/cancel churn, measured: a `weightstream serve` process's resident memory while clients open
streams, take one message and cancel, over and over, and once they have stopped.

Each case starts a fresh server on a Llama-shaped checkpoint of 143 MB with the server's default
settings (its read-ahead, --max-streams), then runs CLIENTS threads, each on its own channel,
opening StreamTensors of the whole model, taking one message and cancelling, for --seconds. It
reports the server's RSS before (idle, after one warm-up load), its peak (VmHWM, reset first) and
its RSS 2 s after the last cancel, for 1 and 4 clients, as growth over idle.

Usage (from the repository root): python benchmarks/churn_memory.py [--seconds 15]
[--runs 3] [--server-pythonpath DIR:DIR] (another checkout's server, for a before/after).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import (
    peak_rss,
    reset_peak_rss,
    rss,
    serve_weightstream,
)
from weightstream.protocol import wire
from weightstream.samples import llama_like_state_dict, save_sharded
from weightstream.v1 import weightstream_pb2 as pb

MODEL = "churn-llama"
MIB = 1024 * 1024
METHOD = "/weightstream.v1.WeightStreamService/StreamTensors"


def churn(target: str, seconds: float, opened: list[int]) -> None:
    options = [("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(target, options=options) as channel:
        method = channel.unary_stream(
            METHOD, request_serializer=pb.StreamTensorsRequest.SerializeToString, response_deserializer=None
        )
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            call = method(pb.StreamTensorsRequest(model=MODEL), timeout=60)
            try:
                next(call)
                opened[0] += 1
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
            finally:
                call.cancel()


def case(root: Path, clients: int, seconds: float, pythonpath: str | None) -> tuple[float, float, float, int]:
    """(idle MiB, peak growth MiB, growth after MiB, streams opened) of one fresh server under clients."""
    with serve_weightstream(root, wire.DEFAULT_CHUNK_BYTES, pythonpath=pythonpath) as (proc, port):
        target = f"127.0.0.1:{port}"
        churn(target, 0.5, [0])  # warm: streamers and channels made, first-use costs paid
        time.sleep(2)
        idle = rss(proc.pid)
        reset_peak_rss(proc.pid)
        opened = [0]
        threads = [threading.Thread(target=churn, args=(target, seconds, opened)) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        peak = peak_rss(proc.pid)
        time.sleep(2)
        after = rss(proc.pid)
    return idle / MIB, (peak - idle) / MIB, (after - idle) / MIB, opened[0]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/churn_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="churn per case (default 15)")
    parser.add_argument("--runs", type=int, default=3, help="fresh servers per case (default 3)")
    parser.add_argument("--server-pythonpath", default=None, help="PYTHONPATH of the server process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="weightstream-churn-") as tmp:
        root = Path(tmp)
        state = llama_like_state_dict(layers=3, hidden=1024, intermediate=2816, vocab=16000)
        save_sharded(state, root / MODEL, shards=2)
        total = sum(t.numel() * t.element_size() for t in state.values())
        results = {
            clients: [case(root, clients, args.seconds, args.server_pythonpath) for _ in range(args.runs)]
            for clients in (1, 4)
        }
    print(f"checkpoint: {total / MIB:.0f} MiB; {args.seconds:g} s of churn per case, {args.runs} fresh servers each")
    print("| clients | idle RSS MiB | peak growth MiB, median (min..max) | after, MiB (min..max) | streams opened |")
    print("|---|---|---|---|---|")
    for clients, rows in results.items():
        idle = statistics.median(r[0] for r in rows)
        peaks, afters = [r[1] for r in rows], [r[2] for r in rows]
        opened = statistics.median(r[3] for r in rows)
        print(
            f"| {clients} | {idle:.0f} | {statistics.median(peaks):+.0f} ({min(peaks):+.0f}..{max(peaks):+.0f}) | "
            f"{statistics.median(afters):+.0f} ({min(afters):+.0f}..{max(afters):+.0f}) | {opened:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
