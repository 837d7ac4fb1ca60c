"""Load a ~1 GB Llama-like checkpoint through weightstream over loopback, beside safetensors from the page cache.

Prints one table of medians (and min..max) over several runs, all measured in this one run:
- baseline: safetensors.torch.load_file of every shard (page cache warm), into fresh tensors,
  then module.load_state_dict (copy into the touched parameters);
- weightstream load_into: gRPC over 127.0.0.1 straight into a module's existing (touched) parameters;
- weightstream load_state_dict: gRPC into freshly allocated tensors (the same allocation as the baseline).

Usage: python benchmarks/core_load.py [--gb 1.0] [--runs 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from weightstream.client import WeightStreamClient
from weightstream.demo import ParameterTree, llama_like_state_dict, save_sharded


@contextmanager
def server_process(root: Path | None) -> Iterator[int]:
    """`weightstream serve` in its own process (as deployed), on a free port; yields the port.

    Settings beyond the model root come from WEIGHTSTREAM_* variables of this process.
    """
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightstream",
            "serve",
            *(["--model-root", str(root)] if root is not None else []),
            "--host",
            "127.0.0.1",
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--log-level",
            "INFO",
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    found: list[int] = []
    ready = threading.Event()

    def watch() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            match = re.search(r"grpc_port=(\d+)", line)
            if match and not found:
                found.append(int(match.group(1)))
                ready.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        if not ready.wait(timeout=60):
            raise RuntimeError("weightstream serve did not report its port within 60 s")
        yield found[0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def write_checkpoint(folder: Path, gb: float) -> tuple[int, dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """A Llama-shaped bfloat16 checkpoint of about gb GB in 4 shards; returns its bytes and tensor shapes."""
    hidden, intermediate, vocab = 2048, 5632, 32000
    layer_bytes = 2 * (4 * hidden * hidden + 3 * hidden * intermediate)
    layers = max(1, round((gb * 1e9 - 2 * 2 * vocab * hidden) / layer_bytes))
    state = llama_like_state_dict(layers=layers, hidden=hidden, intermediate=intermediate, vocab=vocab)
    save_sharded(state, folder, shards=4)
    return sum(t.numel() * t.element_size() for t in state.values()), {
        n: (tuple(t.shape), t.dtype) for n, t in state.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (default 1.0)")
    parser.add_argument("--runs", type=int, default=5, help="runs per path (default 5)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="weightstream-bench-") as tmp:
        root = Path(tmp)
        total, shapes = write_checkpoint(root / "bench", args.gb)
        files = sorted((root / "bench").glob("*.safetensors"))
        module = ParameterTree(shapes)  # touched once (zeros), reused by every run
        results: dict[str, list[float]] = {
            "safetensors load_file + load_state_dict": [],
            "weightstream load_into": [],
            "weightstream load_state_dict": [],
        }
        with server_process(root) as port, WeightStreamClient(f"127.0.0.1:{port}", progress=False) as client:
            client.load_into(module, "bench")  # warm: page cache, streamer threads, channel
            for _ in range(args.runs):
                started = time.perf_counter()
                loaded: dict[str, torch.Tensor] = {}
                for f in files:
                    loaded.update(load_file(str(f)))
                module.load_state_dict(loaded)
                results["safetensors load_file + load_state_dict"].append(time.perf_counter() - started)
                del loaded

                started = time.perf_counter()
                client.load_into(module, "bench")
                results["weightstream load_into"].append(time.perf_counter() - started)

                started = time.perf_counter()
                sd = client.load_state_dict("bench")
                results["weightstream load_state_dict"].append(time.perf_counter() - started)
                del sd

    baseline = statistics.median(results["safetensors load_file + load_state_dict"])
    print(
        f"checkpoint: {total / 1e9:.2f} GB bfloat16, {len(shapes)} tensors, 4 shards; {args.runs} runs each; "
        "server in its own process on 127.0.0.1; it and the client share this machine's cores"
    )
    print("| path | median GB/s | min..max GB/s | median s | vs baseline |")
    print("|---|---|---|---|---|")
    for name, times in results.items():
        rates = sorted(total / t / 1e9 for t in times)
        median = statistics.median(times)
        print(
            f"| {name} | {total / median / 1e9:.2f} | {rates[0]:.2f}..{rates[-1]:.2f} | {median:.3f} | "
            f"{baseline / median:.2f}x |"
        )


if __name__ == "__main__":
    main()
