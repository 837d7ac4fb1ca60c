"""Run in the vLLM environment (.venv-vllm): an engine loaded through weightstream, updated in place.

Usage: python tests/support/vllm_scripts/update.py CONFIG_DIR TARGET MODEL_ID NEW_DIR MODE TP STORAGE_DIR
    [PUBLISH_TO [deltas]]

Builds an LLM on CONFIG_DIR with load_format="weightstream" and the weightstream weight-transfer
backend, generates greedily, then makes NEW_DIR's safetensors the model's next revision: MODE
"publish" publishes them from this process (a trainer would) to PUBLISH_TO (default TARGET: a
sidecar's upstream, say), MODE "storage" moves them over the
files in STORAGE_DIR (the model folder of TARGET or of its upstream) and takes the revision that
TARGET's watch then reports, and pulls it into the running engine through
vLLM's weight-transfer API (start, update, finish), and generates again. With "deltas" the engine's
init_info asks for XOR deltas (a host copy of each rank's slices). Prints one line
`RESULT {"before": [[...]], "after": [[...]], "update_seconds": S, "revision": R}`; the engine's
own log lines (stderr) say what each rank received.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

PROMPTS = ["w1 w2 w3 w4", "w10 w200 w30", "w5 w5 w5 w5 w5 w5"]
MAX_TOKENS = 8


def main() -> None:
    config_dir, target, model_id, new_dir, mode, tp = sys.argv[1:7]
    storage_dir = Path(sys.argv[7])
    publish_to = sys.argv[8] if len(sys.argv) > 8 else target
    deltas = len(sys.argv) > 9 and sys.argv[9] == "deltas"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.config import WeightTransferConfig

    from weightstream.client import WeightStreamClient
    from weightstream.client.vllm_transfer import sync_weights

    llm = LLM(
        model=config_dir,
        load_format="weightstream",
        model_loader_extra_config={"target": target, "model": model_id},
        weight_transfer_config=WeightTransferConfig(backend="weightstream"),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        tensor_parallel_size=int(tp),
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    before = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.init_weight_transfer_engine({"init_info": {"target": target, "model": model_id, "deltas": deltas}})
    files = sorted(Path(new_dir).glob("*.safetensors"))
    if mode == "publish":
        tensors = {name: t for f in files for name, t in load_file(str(f)).items()}
        with WeightStreamClient(publish_to, progress=False) as client:
            revision = client.publish(model_id, tensors)
    else:
        # As a deployment would: watch the model, replace its files, and pull the revision the watch
        # names (every rank the same one, whatever comes after).
        with WeightStreamClient(target, progress=False) as client:
            events = client.watch(model_id)
            held = next(events).revision
            for f in files:
                staged = storage_dir / (f.name + ".incoming")
                shutil.copyfile(f, staged)
                staged.replace(storage_dir / f.name)
            revision = next(events).revision
            events.close()
        assert revision != held, revision
    started = time.perf_counter()
    sync_weights(llm, revision)
    update_seconds = time.perf_counter() - started
    after = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    result = {"before": before, "after": after, "update_seconds": update_seconds, "revision": revision}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
