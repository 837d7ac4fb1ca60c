"""SGLang (TP=1): start-up load and an in-place update through weightstream, against SGLang's own loader.

A random float32 Llama (head size 64; the default is about 330 MB) is written as safetensors shards
under a temp folder and served by `weightstream serve` in its own process, with a data port and
publishing allowed. B changes 10% of its tensors (every tenth by name). In one SGLang process
(.venv-sglang, CPU), per run and interleaved:

- SGLang's own loader on A's files (page cache warm after the first read): its start-up weight load,
  then `update_weights_from_disk` to B's files (the baseline update: it reads every tensor again);
- load_format="weightstream" from a folder holding only config.json (the tcp transport's data
  port, or shared memory with --transport shm; A published beforehand, so in the server's memory
  as in an RL loop), then B published by a trainer and `sync_weights(engine, B)` (only the changed
  tensors).

Load: SGLang's own "Load weight end. elapsed" line for both loaders. Update: the wall time of the
update call (both pause generation, load, flush the cache). Greedy tokens of the two engines must
agree before and after the update. Prints medians, spreads and the ratios (goals: load >= 0.5x
SGLang's own loader's speed, update >= 2x faster than update_weights_from_disk).

Usage (from the repository root, after `make sglang-venv` or `make test`):
    .venv/bin/python benchmarks/sglang_load.py [--hidden 1024] [--layers 8] [--runs 2] [--transport tcp|shm]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import serve_weightstream
from tests.support.sglang_runs import (
    engine_sessions,
    ensure_sglang_venv,
    sglang_llama_config,
    write_sglang_llama,
)
from tests.support.vllm_runs import write_config_folder
from weightstream.client import WeightStreamClient
from weightstream.samples import save_sharded

MODEL = "sglang-bench"
_LOAD_END = re.compile(r"Load weight end\. elapsed=([0-9.]+) s")


def _state(folder: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size, a multiple of 64 (default 1024)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--runs", type=int, default=2, help="runs of each engine (default 2)")
    parser.add_argument(
        "--transport",
        choices=["tcp", "shm"],
        default="tcp",
        help="weightstream's transport: tcp (the data port, the default) or shm (shared memory, same host)",
    )
    args = parser.parse_args()
    ensure_sglang_venv()
    config = sglang_llama_config(hidden=args.hidden, layers=args.layers, intermediate=args.hidden * 2)
    with (
        tempfile.TemporaryDirectory(prefix="weightstream-sglang-") as tmp,
        tempfile.TemporaryDirectory(prefix="weightstream-sglang-shm-", dir="/dev/shm") as shm_dir,
    ):
        root = Path(tmp) / "models"
        nbytes = write_sglang_llama(root / MODEL, config)
        state = _state(root / MODEL)
        names = sorted(state)
        changed = names[::10]
        generator = torch.Generator().manual_seed(7)
        b_state = dict(state)
        for name in changed:
            b_state[name] = torch.randn(state[name].shape, generator=generator) * 0.2
        b_dir = Path(tmp) / "B" / MODEL
        save_sharded(b_state, b_dir, shards=2)
        write_config_folder(b_dir, config)
        changed_bytes = sum(b_state[n].numel() * b_state[n].element_size() for n in changed)
        config_dir = Path(tmp) / "configs" / MODEL
        write_config_folder(config_dir, config)
        print(
            f"checkpoint: {nbytes / 1e6:.1f} MB float32, hidden {args.hidden}, {args.layers} layers; B changes "
            f"{len(changed)} of {len(names)} tensors ({changed_bytes / 1e6:.1f} MB)",
            flush=True,
        )
        loads: dict[str, list[float]] = {"sglang": [], "weightstream": []}
        updates: dict[str, list[float]] = {"sglang": [], "weightstream": []}
        shm = ["--shm-dir", shm_dir] if args.transport == "shm" else []
        loader = {"transport": args.transport} | ({"shm_dir": shm_dir} if args.transport == "shm" else {})
        with serve_weightstream(root, 4 * 1024 * 1024, ["--allow-publish", *shm]) as (_process, port):
            target = f"127.0.0.1:{port}"
            # Every run's engine loads A as an RL loop's engine would, published (in the server's memory),
            # as SGLang's own loader reads A from the page cache, warm after the first read.
            with WeightStreamClient(target, progress=False) as client:
                client.publish(MODEL, state)
            for run in range(args.runs):
                specs = [
                    {
                        "engine": {"model_path": str(root / MODEL)},
                        "steps": [{"do": "generate"}, {"do": "from_disk", "path": str(b_dir)}, {"do": "generate"}],
                    },
                    {
                        "engine": {
                            "model_path": str(config_dir),
                            "load_format": "weightstream",
                            "model_loader_extra_config": {"target": target, "model": MODEL} | loader,
                        },
                        "steps": [
                            {"do": "generate"},
                            {"do": "publish", "target": target, "model": MODEL, "dir": str(b_dir), "name": "$B"},
                            {"do": "sync", "revision": "$B"},
                            {"do": "generate"},
                        ],
                    },
                ]
                own, streamed = engine_sessions(specs, Path(tmp))
                assert own.tokens(0) == streamed.tokens(0), "the loaders disagree on A"
                assert own.tokens(2) == streamed.tokens(3), "the updates disagree on B"
                elapsed = [float(m.group(1)) for m in _LOAD_END.finditer(own.log)]
                # Two engines per process, in order: SGLang's own loader, then weightstream's.
                loads["sglang"].append(elapsed[-2])
                loads["weightstream"].append(elapsed[-1])
                updates["sglang"].append(own.step(1)["update_seconds"])
                updates["weightstream"].append(streamed.step(2)["update_seconds"])
                print(
                    f"run {run + 1}: load {elapsed[-2]:.2f} s (own) / {elapsed[-1]:.2f} s (weightstream); update "
                    f"{updates['sglang'][-1]:.3f} s (update_weights_from_disk) / "
                    f"{updates['weightstream'][-1]:.3f} s (sync_weights)",
                    flush=True,
                )
                # The current revision is B now: A again for the next run.
                with WeightStreamClient(target, progress=False) as client:
                    client.publish(MODEL, state)

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})"

    own_load, ws_load = statistics.median(loads["sglang"]), statistics.median(loads["weightstream"])
    own_update, ws_update = statistics.median(updates["sglang"]), statistics.median(updates["weightstream"])
    print(f"\nSGLang TP=1, {nbytes / 1e6:.0f} MB float32, median of {args.runs} (min-max)\n")
    print("| step | SGLang's own | weightstream | ratio | goal |")
    print("|---|---|---|---|---|")
    load_speed = own_load / ws_load if ws_load else float("inf")
    update_speed = own_update / ws_update if ws_update else float("inf")
    print(
        f"| start-up load | {cell(loads['sglang'])} (safetensors, local files) | {cell(loads['weightstream'])} "
        f"({args.transport}) | {load_speed:.2f}x the speed | >= 0.5x |"
    )
    print(
        f"| update, 10% of tensors changed | {cell(updates['sglang'])} (update_weights_from_disk) | "
        f"{cell(updates['weightstream'])} (sync_weights, {args.transport}) | {update_speed:.2f}x faster | >= 2x |"
    )


if __name__ == "__main__":
    main()
