"""What update_into's check of the bytes it keeps costs: verify_unchanged on against off, in one run.

update_into keeps the bytes GetChanges calls unchanged since the revision the module holds; with
verify_unchanged (on by default for host memory) it first checksums every whole 1 MiB block it keeps
and compares it with the new revision's block CRC32C. That check reads the kept bytes once, so what
it costs depends on how much of the model the update keeps:

- a tenth of the tensors stepped (2% of their elements changed): the update keeps about 90% of the
  model, the case where the check costs the most next to the update's own work;
- every tensor stepped (2% of the elements): every block changed, nothing is kept, nothing checked;
- nothing changed (since is the current revision): the check is all the update does.

A `weightstream serve --allow-publish` process holds revision A of a Llama-shaped bfloat16 checkpoint
of --gb GB, published, and each B. Each run updates a module set back to A (not timed) with the
check on and then off, alternating, over the data port. Reported: medians of --runs of the update's
seconds with and without the check, their ratio, and the check alone (wire.crc32c over every block of
the module, on the client's delta threads), in GB/s. With --device cuda:0 the module lives on that
GPU and the check copies the kept bytes to host memory first (verify_unchanged=True).

Usage (from the repository root): python benchmarks/unchanged_check.py [--gb 1] [--runs 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import check_module, reset_module, serve_weightstream, write_checkpoint
from weightstream.client import WeightStreamClient
from weightstream.client.deltas import APPLIER_THREADS
from weightstream.client.unchanged import Kept, stale
from weightstream.protocol import wire
from weightstream.samples import ParameterTree

MODEL = "unchanged-check"
BLOCK_BYTES = 1024 * 1024


def stepped(state: dict[str, torch.Tensor], share: float, seed: int) -> dict[str, torch.Tensor]:
    """state with 2% of the elements changed, at random places, in every 1/share-th tensor (all: share 1)."""
    generator = torch.Generator().manual_seed(seed)
    every = max(1, round(1 / share)) if share > 0 else 0
    out = {}
    for index, (name, tensor) in enumerate(state.items()):
        if not every or index % every:
            out[name] = tensor
            continue
        flat = tensor.clone().view(-1)
        places = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=generator)
        flat[places] = (flat[places].float() * 1.01 + 0.01).to(tensor.dtype)
        out[name] = flat.view(tensor.shape)
    return out


def check_alone(module: torch.nn.Module, runs: int) -> float:
    """GB/s of the check over every block of module's host parameters (median of runs)."""
    targets = []
    total = 0
    for name, parameter in module.named_parameters():
        data = parameter.detach().reshape(-1).view(torch.uint8)
        crcs = tuple(0 for _ in range(0, data.numel(), BLOCK_BYTES))  # every block "differs": all are read
        targets.append(Kept(name, data, [(0, data.numel())], 0, data.numel(), crcs))
        total += data.numel()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        stale(targets, BLOCK_BYTES, APPLIER_THREADS)
        times.append(time.perf_counter() - started)
    return total / statistics.median(times) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size (default 1)")
    parser.add_argument("--runs", type=int, default=5, help="runs per case (default 5)")
    parser.add_argument("--device", default="cpu", help="where the module lives (cpu, cuda:0)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA device here: nothing measured on {device}")
        return 0
    cases = [("a tenth of the tensors stepped", 0.1), ("every tensor stepped", 1.0), ("nothing changed", 0.0)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="weightstream-unchanged-") as tmp:
        total, shapes = write_checkpoint(Path(tmp) / "files", args.gb)
        root = Path(tmp) / "root"
        root.mkdir()
        extra = ["--allow-publish", "--keep-revisions", str(len(cases) + 2)]
        extra += ["--publish-max-bytes", str(int((len(cases) + 3) * total))]
        with serve_weightstream(root, wire.DEFAULT_CHUNK_BYTES, extra) as (_proc, port):
            from safetensors.torch import load_file

            a: dict[str, torch.Tensor] = {}
            for path in sorted((Path(tmp) / "files").glob("*.safetensors")):
                a.update(load_file(str(path)))
            module = ParameterTree(shapes).to(device)
            with WeightStreamClient(f"127.0.0.1:{port}", progress=False) as client:
                revision_a = client.publish(MODEL, a, revision="a")
                for label, share in cases:
                    b = stepped(a, share, seed=int(share * 100) + 1) if share else a
                    revision_b = client.publish(MODEL, b, revision=f"b-{share}") if share else revision_a
                    seconds: dict[bool, list[float]] = {True: [], False: []}
                    kept = 0
                    for _ in range(args.runs):
                        for verify in (True, False):
                            reset_module(module, a)
                            report = client.update_into(
                                module, MODEL, since=revision_a, revision=revision_b, verify_unchanged=verify
                            )
                            assert report.revision == revision_b and not report.stale_bytes
                            seconds[verify].append(report.seconds)
                            kept = total - report.bytes
                    check_module(module, b)
                    on, off = statistics.median(seconds[True]), statistics.median(seconds[False])
                    rows.append((label, kept / total, on, off))
        alone = check_alone(module, args.runs) if device.type == "cpu" else 0.0
    print(f"checkpoint: {total / 1e9:.2f} GB bfloat16, {len(shapes)} tensors on {device}; medians of {args.runs}")
    print("| case | kept (checked) | update, checked s | update, unchecked s | x unchecked | check's share |")
    print("|---|---|---|---|---|---|")
    for label, share, on, off in rows:
        print(f"| {label} | {share:.0%} | {on:.3f} | {off:.3f} | {on / off:.2f}x | {(on - off) / on:.0%} |")
    if alone:
        print(f"the check alone: {alone:.1f} GB/s over every block of the module ({APPLIER_THREADS} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
