"""Run in the vLLM environment (.venv-vllm) by benchmarks/updates.py: vLLM's own in-place reload from disk.

Usage: python benchmarks/vllm_reload_script.py MODEL_DIR NEW_DIR

Builds an LLM on MODEL_DIR (load_format="safetensors"), then reloads NEW_DIR's weights into it in
place with vLLM's reload_weights(weights_path=...) (every worker, through collective_rpc), and
prints one line `RESULT {"reload_seconds": S}`.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    model_dir, new_dir = sys.argv[1:3]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    llm = LLM(model=model_dir, load_format="safetensors", dtype="float32", enforce_eager=True, max_model_len=256)
    started = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": new_dir, "is_checkpoint_format": True})
    print("RESULT " + json.dumps({"reload_seconds": time.perf_counter() - started}), flush=True)


if __name__ == "__main__":
    main()
