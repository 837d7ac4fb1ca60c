"""vLLM's weight loading with load_format="weightstream" (gRPC, the data port, shared memory) against safetensors.

A random float32 Llama (head size 64; the default is about 410 MB) is written as safetensors shards
under a temp folder and served by `weightstream serve` in its own process, with a shared-memory
directory and a data port. Then vLLM (CPU build, in .venv-vllm) is started --runs times with each
loader at each tensor-parallel size, interleaved: weightstream over gRPC, over the tcp transport's data
connection (transport tcp, the network path) and over shared memory, from a folder
holding only config.json and the tokenizer; safetensors from the folder with the weights (the page
cache warm after the first read). Each run greedy-generates the same prompts, and the token ids of
the loaders must agree at each size (TP=2 is compared with TP=2: splitting the matrix
products changes the order of float additions).

Per run it records each loader's own load_weights time from vLLM's log, the slowest rank's
(DefaultModelLoader's "Loading weights took", 2 decimals; the weightstream loader's line, which
includes connecting, the manifest and the plan), and the bytes each rank received (weightstream's
line; vLLM's safetensors loader reads every file on every rank: 1.00x). Prints medians, spreads
and the ratio to the safetensors loader at the same size (the baseline).

TP=2 runs two CPU workers, one core each (VLLM_CPU_OMP_THREADS_BIND).

Usage (from the repository root, after `make vllm-venv` or `make test`):
    .venv/bin/python benchmarks/vllm_load.py [--hidden 1024] [--layers 8] [--runs 3] [--tp 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import serve_weightstream
from tests.support.ports import free_ports
from tests.support.vllm_runs import (
    EngineRun,
    ensure_vllm_venv,
    run_engine,
    vllm_llama_config,
    write_config_folder,
    write_vllm_llama,
)

MODEL = "vllm-bench"
BASELINE = "safetensors"
TRANSPORT = {
    "weightstream-grpc": "transport grpc",
    "weightstream-tcp": "transport tcp",
    "weightstream-shm": "transport shm",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size, a multiple of 64 (default 1024)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--runs", type=int, default=3, help="engine starts per loader and size (default 3)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes (default 1 2)")
    args = parser.parse_args()
    ensure_vllm_venv()
    config = vllm_llama_config(hidden=args.hidden, layers=args.layers, intermediate=args.hidden * 11 // 4)
    runs: dict[tuple[int, str], list[EngineRun]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="weightstream-vllm-") as tmp,
        tempfile.TemporaryDirectory(prefix="weightstream-vllm-shm-", dir="/dev/shm") as shm_dir,
    ):
        root = Path(tmp) / "models"
        nbytes = write_vllm_llama(root / MODEL, config)
        config_folder = Path(tmp) / "configs" / MODEL
        write_config_folder(config_folder, config)
        print(f"checkpoint: {nbytes / 1e6:.1f} MB float32, hidden {args.hidden}, {args.layers} layers", flush=True)
        data_port = free_ports(1)[0]
        extra = ["--shm-dir", shm_dir, "--data-port", str(data_port)]
        with serve_weightstream(root, 4 * 1024 * 1024, extra) as (_process, port):
            target = f"127.0.0.1:{port}"
            loaders: dict[str, tuple[Path, str, dict[str, object]]] = {
                "weightstream-grpc": (config_folder, "weightstream", {"target": target, "transport": "grpc"}),
                "weightstream-tcp": (config_folder, "weightstream", {"target": target, "transport": "tcp"}),
                "weightstream-shm": (config_folder, "weightstream", {"target": target, "shm_dir": shm_dir}),
                BASELINE: (root / MODEL, "safetensors", {}),
            }
            for i in range(args.runs):
                for tp in args.tp:
                    tokens = set()
                    for name, (folder, load_format, extra) in loaders.items():
                        run = run_engine(folder, load_format, extra, tp=tp)
                        runs.setdefault((tp, name), []).append(run)
                        tokens.add(repr(run.token_ids))
                        used = TRANSPORT.get(name)
                        if used and not (run.weightstream_lines and all(used in x for x in run.weightstream_lines)):
                            raise SystemExit(f"{name}: not every rank used {used}: {run.weightstream_lines}")
                    print(f"run {i + 1}/{args.runs} TP={tp}: token ids identical: {len(tokens) == 1}", flush=True)
                    if len(tokens) != 1:
                        raise SystemExit("the loaders generated different tokens")
    header = f"{'TP':>3} {'loader':<19}{'load_weights s':>15}{'spread':>14}{'GB/s':>7}{'vs ' + BASELINE:>16}"
    print(header + f"{'bytes/rank (max)':>18}{'all ranks':>11}{'LLM() s':>9}")
    for tp in args.tp:
        base = statistics.median(_loads(runs[(tp, BASELINE)]))
        for name in loaders:
            results = runs[(tp, name)]
            loads = _loads(results)
            median = statistics.median(loads)
            per_rank = [max(r.received_bytes) / nbytes for r in results if r.received_bytes]
            together = [sum(r.received_bytes) / nbytes for r in results if r.received_bytes]
            rank_text = f"{statistics.median(per_rank):.3f}x" if per_rank else "1.000x"
            all_text = f"{statistics.median(together):.3f}x" if together else f"{tp:.3f}x"
            print(
                f"{tp:>3} {name:<19}{median:>15.3f}{f'{min(loads):.3f}-{max(loads):.3f}':>14}"
                f"{nbytes / median / 1e9:>7.2f}{base / median:>15.2f}x{rank_text:>18}{all_text:>11}"
                f"{statistics.median(r.init_seconds for r in results):>9.1f}"
            )
    print(f"vs {BASELINE}: its load_weights time / this loader's (above 1: faster), same TP size, same run")


def _loads(results: list[EngineRun]) -> list[float]:
    loads = [r.load_seconds for r in results if r.load_seconds is not None]
    if not loads:
        raise SystemExit("no load_weights time in vLLM's log")
    return loads


if __name__ == "__main__":
    main()
