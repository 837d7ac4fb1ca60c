"""The CUDA path of load_into, measured on a GPU: pinned staging ring, non-blocking copies, events.

Loads a Llama-shaped checkpoint over loopback gRPC straight into a module whose parameters live on
cuda:0, checks every parameter bit for bit against the checkpoint, and compares the time with
safetensors.torch.load_file(device="cuda:0") plus load_state_dict, side by side. On a machine
without CUDA it says so and measures nothing.

Usage: python benchmarks/cuda_load.py [--gb 1] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing measured (the CPU path is covered by the test suite)")
        return 0
    from safetensors.torch import load_file

    from weightstream.allocator import tune_malloc
    from weightstream.bench import serve_weightstream, write_checkpoint
    from weightstream.client import WeightStreamClient
    from weightstream.demo import ParameterTree

    tune_malloc()
    device = torch.device("cuda:0")
    with tempfile.TemporaryDirectory(prefix="weightstream-cuda-") as tmp:
        root = Path(tmp)
        total, shapes = write_checkpoint(root / "m", args.gb)
        files = sorted(str(p) for p in (root / "m").glob("*.safetensors"))
        module = ParameterTree(shapes).to(device)
        times: dict[str, list[float]] = {"weightstream load_into (cuda:0)": [], "safetensors load_file(cuda:0)": []}
        with serve_weightstream(root, 4 << 20) as (_server, port), WeightStreamClient(f"127.0.0.1:{port}") as client:
            client.load_into(module, "m")
            for _ in range(args.runs):
                torch.cuda.synchronize()
                started = time.perf_counter()
                client.load_into(module, "m")
                torch.cuda.synchronize()
                times["weightstream load_into (cuda:0)"].append(time.perf_counter() - started)
                started = time.perf_counter()
                loaded: dict[str, torch.Tensor] = {}
                for f in files:
                    loaded.update(load_file(f, device="cuda:0"))
                module.load_state_dict(loaded)
                torch.cuda.synchronize()
                times["safetensors load_file(cuda:0)"].append(time.perf_counter() - started)
                del loaded
            client.load_into(module, "m")
        reference: dict[str, torch.Tensor] = {}
        for f in files:
            reference.update(load_file(f))
        mismatched = [
            n for n, p in module.named_parameters() if not torch.equal(p.detach().cpu().view(torch.uint8),
                                                                      reference[n].view(torch.uint8))
        ]  # fmt: skip
    print(f"checkpoint: {total / 1e9:.2f} GB bfloat16 on {torch.cuda.get_device_name(device)}; {args.runs} runs")
    print("| path | median GB/s | min..max GB/s |")
    print("|---|---|---|")
    for name, values in times.items():
        rates = sorted(total / t / 1e9 for t in values)
        print(f"| {name} | {total / statistics.median(values) / 1e9:.2f} | {rates[0]:.2f}..{rates[-1]:.2f} |")
    print("verify: " + (f"FAILED, {len(mismatched)} tensors differ" if mismatched else "every parameter bit-identical"))
    return 1 if mismatched else 0


if __name__ == "__main__":
    raise SystemExit(main())
