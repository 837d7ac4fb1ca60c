"""Run in the vLLM environment (.venv-vllm) by benchmarks/rl_step.py: one vLLM engine, a trainer, timed RL steps.

Usage: python benchmarks/rl_step_script.py SETTINGS_JSON

SETTINGS_JSON: {"mode": "weightstream" or "disk", "model_dir" (what LLM() is started on: config and
tokenizer, plus revision A's safetensors for "disk"), "weights" (revision A's safetensors folder, the
trainer's first weights), "target", "model", "http_port" (the weightstream server's), "steps",
"warmup", "fraction", "seed", "out" (disk: the folder the trainer saves to)}.

The engine runs in float32 (vLLM's bfloat16 CPU kernels crash on some machines); the trainer's
weights, what it publishes and what it saves are bfloat16, converted by vLLM as it loads them. Each
step changes `fraction` of the elements of every tensor of the trainer's module in place (not
timed), then:

- weightstream: the engine is loaded with load_format="weightstream" from the server; the trainer's
  `send_weights()` (WeightTransferTrainerFactory, the weightstream backend, OfflineLLMClient), first
  with init_info deltas off for warmup + steps steps, then on for as many, then "auto" for as many
  plus the two in which it measures both ways (AUTO_MEASURING). After each step (not
  timed) a full `load_into` of the just-published revision over the data port into a bfloat16 module
  of the same shapes: the baseline a first engine's update is compared with.
- disk: the engine is loaded with load_format="safetensors" from model_dir; the trainer saves its
  weights with safetensors' save_file to `out` and the engine reloads them in place with vLLM's
  reload_weights(weights_path=out) on every worker.

Prints one line `RESULT {"blocks": {NAME: [step, ...]}, ...}`; each step holds its seconds and, for
weightstream, the bytes the server received and sent during it (/status).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

# The publishes against a base in which deltas="auto" measures both ways (revisions.SendChoice).
AUTO_MEASURING = 2


def main() -> None:
    settings = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    trainer = trainer_module(Path(settings["weights"]))
    generator = torch.Generator().manual_seed(int(settings["seed"]))
    steps = int(settings["warmup"]) + int(settings["steps"])
    if settings["mode"] == "disk":
        result = disk(settings, trainer, generator, steps)
    else:
        result = weightstream(settings, trainer, generator, steps)
    print("RESULT " + json.dumps(result), flush=True)


def trainer_module(folder: Path) -> torch.nn.Module:
    """The trainer's model: a module holding revision A's bfloat16 tensors under their checkpoint names."""
    from safetensors.torch import load_file

    from weightstream.samples import ParameterTree

    state: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(path)))
    module = ParameterTree({name: (tuple(t.shape), t.dtype) for name, t in state.items()})
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            parameter.copy_(state[name])
    return module


def step(module: torch.nn.Module, fraction: float, generator: torch.Generator) -> None:
    """An optimizer step, sparse: fraction of the elements of every parameter changed at random places."""
    with torch.no_grad():
        for parameter in module.parameters():
            flat = parameter.view(-1)
            places = torch.randint(0, flat.numel(), (max(1, int(fraction * flat.numel())),), generator=generator)
            flat[places] = (flat[places].float() * 1.01 + 0.01).to(flat.dtype)


def llm(model_dir: str, load_format: str, extra: dict[str, object] | None = None, **kwargs: Any) -> Any:
    from vllm import LLM

    return LLM(
        model=model_dir,
        load_format=load_format,
        model_loader_extra_config=extra or {},
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        **kwargs,
    )


def weightstream(
    settings: dict[str, Any], trainer: torch.nn.Module, generator: torch.Generator, steps: int
) -> dict[str, Any]:
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightstream.client import WeightStreamClient
    from weightstream.client.vllm_transfer import OfflineLLMClient, WeightStreamTrainerInitInfo
    from weightstream.samples import ParameterTree

    target, model = settings["target"], settings["model"]
    # transport tcp: the data port on both sides, the path another host's engine takes.
    started = time.perf_counter()
    engine = llm(
        settings["model_dir"],
        "weightstream",
        {"target": target, "model": model, "transport": "tcp"},
        weight_transfer_config=WeightTransferConfig(backend="weightstream"),
    )
    init_seconds = time.perf_counter() - started
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in trainer.named_parameters()}
    baseline = ParameterTree(shapes)
    blocks: dict[str, list[dict[str, Any]]] = {}
    with WeightStreamClient(target, transport="tcp", progress=False) as puller:
        for deltas in (False, True, "auto"):
            sender = WeightTransferTrainerFactory.trainer_init(
                WeightStreamTrainerInitInfo(target=target, model=model, transport="tcp", deltas=deltas, rank=0),
                client=OfflineLLMClient(engine),
                source=ModuleSource(trainer),
            )
            records = []
            # deltas="auto" measures both ways in its first two publishes against a base: two steps more.
            for _ in range(steps + (AUTO_MEASURING if deltas == "auto" else 0)):
                step(trainer, float(settings["fraction"]), generator)
                before = counters(settings["http_port"])
                sender.send_weights()
                after = counters(settings["http_port"])
                report = sender.last_step
                assert report is not None
                load = puller.load_into(baseline, model)
                records.append(
                    {
                        "revision": report.revision,
                        "seconds": report.seconds,
                        "publish_seconds": report.publish_seconds,
                        "update_seconds": report.update_seconds,
                        "publish_sent_bytes": report.publish_sent_bytes,
                        "received_bytes": after[0] - before[0],
                        "served_bytes": after[1] - before[1],
                        "full_load_seconds": load.seconds,
                        "full_load_bytes": load.bytes,
                    }
                )
            sender.shutdown()
            blocks[{False: "whole", True: "deltas", "auto": "auto"}[deltas]] = records
    for name, parameter in trainer.named_parameters():
        if not torch.equal(parameter.view(torch.int16), baseline.get_parameter(name).view(torch.int16)):
            raise SystemExit(f"{name}: the last published revision is not the trainer's weights")
    return {"blocks": blocks, "init_seconds": init_seconds}


def disk(settings: dict[str, Any], trainer: torch.nn.Module, generator: torch.Generator, steps: int) -> dict[str, Any]:
    from safetensors.torch import save_file

    started = time.perf_counter()
    engine = llm(settings["model_dir"], "safetensors")
    init_seconds = time.perf_counter() - started
    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for _ in range(steps):
        step(trainer, float(settings["fraction"]), generator)
        started = time.perf_counter()
        save_file({name: p.detach() for name, p in trainer.named_parameters()}, str(out / "model.safetensors"))
        saved = time.perf_counter()
        engine.collective_rpc("reload_weights", kwargs={"weights_path": str(out), "is_checkpoint_format": True})
        finished = time.perf_counter()
        records.append(
            {
                "seconds": finished - started,
                "save_seconds": saved - started,
                "reload_seconds": finished - saved,
                "file_bytes": (out / "model.safetensors").stat().st_size,
            }
        )
    return {"blocks": {"disk": records}, "init_seconds": init_seconds}


def counters(http_port: int) -> tuple[int, int]:
    """The server's bytes received from publishers and bytes served, from its /status."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=30) as answer:
        status = json.loads(answer.read())
    return int(status["revisions"]["publish_received_bytes_total"]), int(status["bytes_served_total"])


if __name__ == "__main__":
    main()
