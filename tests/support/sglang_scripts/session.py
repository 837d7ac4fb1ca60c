"""Run in the SGLang environment (.venv-sglang), not under pytest: one SGLang engine, a list of steps.

Usage: python tests/support/sglang_scripts/session.py SPEC_JSON

SPEC: {"engine": {Engine keyword arguments on top of the CPU ones below}, "steps": [STEP, ...]}, or
{"starts": [{"engine": {...}, "steps": [...]}, ...]} to start several engines one after the other in
this process (importing SGLang once), each running its steps. An engine that fails to start ends
this process (its scheduler's SIGQUIT makes SGLang end the whole process tree), with the error in
the log. A STEP is one of
    {"do": "generate"}                                  greedy tokens of PROMPT_IDS
    {"do": "sync", "revision": R}                       weightstream.client.sglang.sync_weights(engine, R)
    {"do": "from_disk", "path": DIR}                    SGLang's own update_weights_from_disk(DIR)
    {"do": "publish", "target": T, "model": M, "dir": D}  publish D's safetensors as M's next revision
    {"do": "replace", "target": T, "model": M, "dir": D, "storage": S}  move D's files over S's, wait for
                                                        the revision T's watch then reports
A step that raises is recorded with its error, and the session goes on. Prints one line
`RESULT {"steps": [{"do": ..., "ok": true|false, "error": "...", "seconds": S, ...}], "init_seconds": S}`,
or with "starts" `RESULT {"starts": [{"ok": true|false, "error": "...", "steps": [...], ...}, ...]}`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# Token ids of a tiny Llama's vocabulary (512): the prompts every run generates from.
PROMPT_IDS = [[1, 5, 6, 7, 8], [1, 10, 200, 30], [1, 5, 5, 5, 5, 5, 5]]
MAX_TOKENS = 8
# DESIGN.md, "SGLang on this machine": what runs a tiny Llama on this CPU.
CPU_ENGINE = {
    "device": "cpu",
    "tp_size": 1,
    "dtype": "float32",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "skip_tokenizer_init": True,
    "mem_fraction_static": 0.3,
    "max_total_tokens": 2048,
    "disable_cuda_graph": True,
    "random_seed": 0,
    "log_level": "info",
}


def generate(engine: Any) -> list[list[int]]:
    params = {"temperature": 0.0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
    outputs = engine.generate(input_ids=PROMPT_IDS, sampling_params=params)
    return [list(out["output_ids"]) for out in outputs]


def run_step(engine: Any, step: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    from weightstream.client import WeightStreamClient
    from weightstream.client.sglang import sync_weights

    do = step["do"]
    if do == "generate":
        return {"token_ids": generate(engine)}
    if do == "sync":
        return {"update_seconds": sync_weights(engine, step["revision"])}
    if do == "from_disk":
        started = time.perf_counter()
        success, message = engine.update_weights_from_disk(model_path=step["path"])[:2]
        if not success:
            raise RuntimeError(message)
        return {"update_seconds": time.perf_counter() - started}
    files = sorted(Path(step["dir"]).glob("*.safetensors"))
    if do == "publish":
        tensors = {name: t for f in files for name, t in load_file(str(f)).items()}
        with WeightStreamClient(step["target"], progress=False) as client:
            return {"revision": client.publish(step["model"], tensors)}
    if do == "replace":
        with WeightStreamClient(step["target"], progress=False) as client:
            events = client.watch(step["model"])
            held = next(events).revision
            for f in files:
                staged = Path(step["storage"]) / (f.name + ".incoming")
                shutil.copyfile(f, staged)
                staged.replace(Path(step["storage"]) / f.name)
            revision = next(events).revision
            events.close()
        assert revision != held, revision
        return {"revision": revision}
    raise ValueError(f"unknown step {do!r}")


def session(spec: dict[str, Any]) -> dict[str, Any]:
    """Start Engine(**spec["engine"]), run spec["steps"], shut it down; what happened."""
    import sglang as sgl

    started = time.perf_counter()
    try:
        engine = sgl.Engine(**(CPU_ENGINE | spec["engine"]))
    except BaseException as exc:  # a failed start ends in SystemExit in places
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "init_seconds": time.perf_counter() - started}
    init_seconds = time.perf_counter() - started
    records = []
    revisions: dict[str, str] = {}
    for step in spec.get("steps", []):
        step = {k: revisions.get(v, v) if isinstance(v, str) else v for k, v in step.items()}
        began = time.perf_counter()
        try:
            record: dict[str, Any] = {"do": step["do"], "ok": True, **run_step(engine, step)}
        except Exception as exc:
            record = {"do": step["do"], "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        record["seconds"] = time.perf_counter() - began
        if "name" in step and "revision" in record:
            revisions[step["name"]] = record["revision"]  # later steps name it as "$name"
        records.append(record)
    engine.shutdown()
    return {"ok": True, "steps": records, "init_seconds": init_seconds}


def main() -> None:
    spec = json.loads(sys.argv[1])
    if "starts" in spec:
        result: dict[str, Any] = {"starts": [session(one) for one in spec["starts"]]}
    else:
        result = session(spec)
        if not result["ok"]:
            raise RuntimeError(result["error"])
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    main()
