"""The engine path on a GPU: plan_loads() + load_targets() into CUDA parameters, checked bit for bit.

What the vLLM loader does on each rank, without vLLM (the GPU machine's image has none): a model
rank with vLLM-style weight loaders (tests/support/rank_model.py: fused qkv blocks, row-parallel
columns, a padded vocabulary, and loaders that must fall back) on --device, a bfloat16 checkpoint
loaded into its float32 parameters (the dtype converted on the device), for each rank of --ranks,
over gRPC (pinned staging) and over shared memory (registered slots, or staging), against the
module's own load_weights over safetensors.torch.load_file(device=...) tensors: every parameter
must be bit-identical, and each rank must receive only its part. Prints the times side by side
(baseline: the module's own loader over load_file). With --device cpu it runs the same checks on
the CPU.

Usage: python benchmarks/cuda_plan_load.py [--hidden 4096] [--ranks 1 2] [--runs 3] [--device cuda:0]
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

SHM_ROOT = Path("/dev/shm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096: a 0.24 GB checkpoint)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (default 1 2)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing measured (run with --device cpu for the same checks on the CPU)")
        return 0
    from safetensors.torch import load_file, save_file

    from benchmarks.harness import serve_weightstream
    from tests.support.rank_model import RankModel, rank_checkpoint
    from weightstream.client import WeightStreamClient
    from weightstream.client.loader_plan import plan_loads

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[tuple[int, str], list[float]] = {}
    received: dict[tuple[int, str], int] = {}
    failures: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="weightstream-plan-") as tmp,
        tempfile.TemporaryDirectory(prefix="weightstream-plan-", dir=SHM_ROOT) as shm_dir,
    ):
        root = Path(tmp)
        (root / "m").mkdir()
        state = rank_checkpoint(torch.bfloat16, hidden=args.hidden)
        path = root / "m" / "model.safetensors"
        save_file(state, str(path))
        total = sum(t.numel() * t.element_size() for t in state.values())
        with (
            serve_weightstream(root, 4 << 20, ["--shm-dir", shm_dir]) as (_server, port),
            WeightStreamClient(f"127.0.0.1:{port}", progress=False, transport="grpc") as grpc_client,
            WeightStreamClient(f"127.0.0.1:{port}", progress=False, transport="shm", shm_dir=shm_dir) as shm,
        ):
            clients = {"weightstream gRPC": grpc_client, "weightstream shm": shm}
            for ranks in args.ranks:
                for rank in range(ranks):
                    expected = RankModel(rank, ranks, args.hidden, device)
                    expected.load_weights(load_file(str(path), device=str(device)).items())
                    for _ in range(args.runs):
                        baseline = RankModel(rank, ranks, args.hidden, device)
                        synchronize()
                        started = time.perf_counter()
                        baseline.load_weights(load_file(str(path), device=str(device)).items())
                        synchronize()
                        times.setdefault((ranks, "own loader over load_file"), []).append(time.perf_counter() - started)
                    for name, client in clients.items():
                        for _ in range(args.runs):
                            module = RankModel(rank, ranks, args.hidden, device)
                            synchronize()
                            started = time.perf_counter()
                            manifest = client.manifest("m")
                            plan = plan_loads(module.load_weights, module, manifest)
                            report = client.load_targets("m", plan.targets, manifest=manifest)
                            module.load_weights(client.iter_tensors("m", names=plan.fallback, device=device))
                            synchronize()
                            times.setdefault((ranks, name), []).append(time.perf_counter() - started)
                            received[(ranks, name)] = max(received.get((ranks, name), 0), report.bytes)
                        for param_name, param in module.named_parameters():
                            want = dict(expected.named_parameters())[param_name]
                            if not torch.equal(param.detach().cpu(), want.detach().cpu()):
                                failures.append(f"{name}, rank {rank} of {ranks}: {param_name} differs")
    print(f"checkpoint: {total / 1e9:.2f} GB bfloat16 into float32 parameters on {device}; {args.runs} runs")
    print("| ranks | path | median s | vs own loader | written in place per rank (max, of the checkpoint) |")
    print("|---|---|---|---|---|")
    for ranks in args.ranks:
        base = statistics.median(times[(ranks, "own loader over load_file")])
        for (size, name), values in times.items():
            if size != ranks:
                continue
            median = statistics.median(values)
            part = f"{received[(size, name)] / total:.3f}x" if (size, name) in received else "1.000x"
            print(f"| {ranks} | {name} | {median:.3f} | {base / median:.2f}x | {part} |")
    print("verify: " + ("FAILED: " + "; ".join(failures[:10]) if failures else "every parameter bit-identical"))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
