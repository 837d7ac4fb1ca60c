"""vLLM's weight loading with load_format="weightstream" against its default safetensors loader, side by side.

A random float32 Llama (head size 64) is written as safetensors shards under a temp folder and
served by `weightstream serve` in its own process. Then vLLM (CPU build, in .venv-vllm) is started
--runs times with each loader, interleaved: weightstream from a folder holding only config.json and
the tokenizer, safetensors from the folder with the weights (page cache warm after the first
read). Each run greedy-generates the same prompts, and the token ids must agree.

Per run it records each loader's own load_weights time from vLLM's log (DefaultModelLoader's
"Loading weights took", 2 decimals; the weightstream loader's line, which includes connecting and
the manifest) and the time LLM(...) took to build. Prints medians, spreads and the ratio.

Usage (from the repository root, after `make vllm-venv` or `make test`):
    .venv/bin/python benchmarks/vllm_load.py [--hidden 1024] [--layers 8] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.vllm_runs import (
    EngineRun,
    ensure_vllm_venv,
    run_engine,
    vllm_llama_config,
    write_config_folder,
    write_vllm_llama,
)
from weightstream.bench import serve_weightstream

MODEL = "vllm-bench"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size, a multiple of 64 (default 1024)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--runs", type=int, default=3, help="engine starts per loader (default 3)")
    args = parser.parse_args()
    ensure_vllm_venv()
    config = vllm_llama_config(hidden=args.hidden, layers=args.layers, intermediate=args.hidden * 11 // 4)
    with tempfile.TemporaryDirectory(prefix="weightstream-vllm-") as tmp:
        root = Path(tmp) / "models"
        nbytes = write_vllm_llama(root / MODEL, config)
        config_folder = Path(tmp) / "configs" / MODEL
        write_config_folder(config_folder, config)
        print(f"checkpoint: {nbytes / 1e6:.1f} MB float32, hidden {args.hidden}, {args.layers} layers", flush=True)
        runs: dict[str, list[EngineRun]] = {"weightstream": [], "safetensors": []}
        with serve_weightstream(root, 4 * 1024 * 1024) as (_process, port):
            for i in range(args.runs):
                runs["weightstream"].append(run_engine(config_folder, "weightstream", {"target": f"127.0.0.1:{port}"}))
                runs["safetensors"].append(run_engine(root / MODEL, "safetensors"))
                same = runs["weightstream"][-1].token_ids == runs["safetensors"][-1].token_ids
                print(f"run {i + 1}/{args.runs}: token ids identical: {same}", flush=True)
                if not same:
                    raise SystemExit("the two loaders generated different tokens")
    print(f"{'loader':<14}{'load_weights s':>16}{'spread':>16}{'GB/s':>8}{'LLM() s':>10}")
    medians: dict[str, float] = {}
    for name, results in runs.items():
        loads = [r.load_seconds for r in results if r.load_seconds is not None]
        inits = [r.init_seconds for r in results]
        medians[name] = statistics.median(loads) if loads else float("nan")
        spread = f"{min(loads):.3f}-{max(loads):.3f}" if loads else "n/a"
        gbps = nbytes / medians[name] / 1e9 if loads and medians[name] > 0 else float("nan")
        print(f"{name:<14}{medians[name]:>16.3f}{spread:>16}{gbps:>8.2f}{statistics.median(inits):>10.1f}")
    ratio = medians["weightstream"] / medians["safetensors"] if medians["safetensors"] > 0 else float("nan")
    print(f"weightstream / safetensors load_weights time: {ratio:.2f}x (baseline: vLLM's DefaultModelLoader)")


if __name__ == "__main__":
    main()
