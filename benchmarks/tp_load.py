"""Tensor-parallel loads from the original checkpoint: what each rank receives, and how long it takes.

A ~1 GB Llama-shaped checkpoint is served by `weightstream serve` (its own process, local files in
the page cache). For world sizes 1, 2 and 4, every rank loads its shard (ShardSpec with the Llama
rules) into a module of the shard's shapes whose memory was touched first, one rank at a time, and
checks it bit for bit against the matching slices of the checkpoint. The baseline is world size 1
(the whole model) in the same run.

Usage: python benchmarks/tp_load.py [--gb 1] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import serve_weightstream, write_checkpoint
from weightstream.client import WeightStreamClient
from weightstream.client.sharding import ShardSpec
from weightstream.samples import ParameterTree


def shard_shapes(shapes: dict, spec: ShardSpec) -> dict:
    out = {}
    for name, (shape, dtype) in shapes.items():
        dim = spec.dim_for(name)
        if dim is not None and spec.world_size > 1:
            shape = tuple(d // spec.world_size if i == dim else d for i, d in enumerate(shape))
        out[name] = (shape, dtype)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (default 1.0)")
    parser.add_argument("--runs", type=int, default=3, help="loads of every rank (default 3)")
    args = parser.parse_args()
    from weightstream.allocator import tune_malloc

    tune_malloc()
    rows = []
    mismatched = 0
    with tempfile.TemporaryDirectory(prefix="weightstream-tp-bench-") as tmp:
        root = Path(tmp)
        total, shapes = write_checkpoint(root / "m", args.gb)
        full = {k: v for f in sorted((root / "m").glob("*.safetensors")) for k, v in load_file(f).items()}
        with (
            serve_weightstream(root, 4 << 20) as (_, port),
            WeightStreamClient(f"127.0.0.1:{port}", progress=False) as c,
        ):
            c.load_into(ParameterTree(shapes), "m")  # warm the page cache, the server and the channel
            for world in (1, 2, 4):
                seconds: list[float] = []
                received: list[int] = []
                for rank in range(world):
                    spec = ShardSpec(rank, world)
                    module = ParameterTree(shard_shapes(shapes, spec))
                    for _ in range(args.runs):
                        started = time.perf_counter()
                        report = c.load_into(module, "m", shard=spec)
                        seconds.append(time.perf_counter() - started)
                        received.append(report.bytes)
                    for name, param in module.named_parameters():
                        dim = spec.dim_for(name)
                        want = full[name]
                        if dim is not None and world > 1:
                            part = want.shape[dim] // world
                            want = want.narrow(dim, rank * part, part)
                        mismatched += not torch.equal(param, want)
                rows.append(
                    (world, statistics.median(received), statistics.median(seconds), min(seconds), max(seconds))
                )
    base = rows[0][2]
    print(
        f"checkpoint: {total / 1e9:.2f} GB bfloat16, {len(shapes)} tensors; Llama rules; every rank loaded "
        f"{args.runs} times, one rank at a time, into touched memory; the server in its own process"
    )
    print("| world size | bytes per rank (median) | of the model | median s per rank | min..max s | vs world 1 |")
    print("|---|---|---|---|---|---|")
    for world, nbytes, med, lo, hi in rows:
        print(
            f"| {world} | {nbytes:,.0f} | {nbytes / total:.3f}x | {med:.3f} | {lo:.3f}..{hi:.3f} | {med / base:.2f}x |"
        )
    print(f"parameters not equal to their slice of the checkpoint: {mismatched}")


if __name__ == "__main__":
    main()
