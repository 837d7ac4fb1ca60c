"""Run in the vLLM environment (.venv-vllm), not under pytest: build a vLLM engine, greedy-generate, print JSON.

Usage: python tests/support/vllm_scripts/engine.py MODEL_DIR LOAD_FORMAT [EXTRA_CONFIG_JSON [TP_SIZE]]

Prints one line `RESULT {"token_ids": [[...], ...], "init_seconds": S}` on stdout: the generated
token ids for each of PROMPTS, and how long building the LLM took. vLLM's own log lines (on
stderr) say how long loading the weights took; the caller reads them there.
"""

from __future__ import annotations

import json
import os
import sys
import time

PROMPTS = ["w1 w2 w3 w4", "w10 w200 w30", "w5 w5 w5 w5 w5 w5"]
MAX_TOKENS = 8


def main() -> None:
    model_dir, load_format = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    # DESIGN.md: float32 and a head size of 64; bfloat16 kernels crash here with an illegal instruction.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=model_dir,
        load_format=load_format,
        model_loader_extra_config=extra,
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        tensor_parallel_size=tp,
    )
    init_seconds = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    print("RESULT " + json.dumps({"token_ids": token_ids, "init_seconds": init_seconds}), flush=True)


if __name__ == "__main__":
    main()
