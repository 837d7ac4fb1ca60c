"""Run in the vLLM environment (.venv-vllm): an RL trainer as users write it, synced through vLLM's trainer API.

Usage: python tests/support/vllm_scripts/trainer.py SETTINGS_JSON

SETTINGS_JSON: {"target", "model", "vllm" (the engine's base URL; "offline": an offline LLM built
in this process with load_format weightstream, driven through OfflineLLMClient; or "ray": the same LLM
as an actor of a local Ray started here, driven through vLLM's RayVLLMWeightSyncClient), "weights" (a
folder of the model's safetensors: revision A, what the engine serves), "config" (its config folder),
"out" (where the trained weights are saved, as safetensors), "steps", "world_size" (1, or 2: two
processes in a gloo group, each publishing half the names), and optionally "engine_target",
"transport", "deltas" (true, false or "auto"), "ray_temp_dir" (Ray's session folder; a short path:
Ray's sockets live there)}.

Each rank builds a transformers Llama from the config, loads A, and takes "steps" AdamW steps on
random tokens (with two ranks, each on its own batch, gradients averaged over the group); after each
step it calls send_weights() of the weightstream trainer engine made by vLLM's
WeightTransferTrainerFactory with vLLM's own HTTPVLLMWeightSyncClient (or RayVLLMWeightSyncClient)
and ModuleSource. A failed send is recorded (its phase) and the loop goes on. After each step rank 0
asks the engine for greedy completions of PROMPTS. Rank 0 prints one line `RESULT {"steps":
[{"revision", "error", "phase", "tokens", "publish_seconds", ...}, ...], "before"}` ("before": the
tokens before the first step, and each step's "weight_version": from an engine of this process only)
and saves the weights as they are after the last step. A Ray started here is shut down before the
process ends, its actor first.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

PROMPTS = ["w1 w2 w3 w4", "w10 w200 w30", "w5 w5 w5 w5 w5 w5"]


def completions(base: str, model: str) -> list[list[int]]:
    import requests

    body = {
        "model": model,
        "prompt": PROMPTS,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    response = requests.post(f"{base}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


def engine_args(settings: dict[str, Any]) -> dict[str, Any]:
    """LLM(...)'s arguments: the config folder, loaded through weightstream, with the weightstream backend."""
    from vllm.config import WeightTransferConfig

    return {
        "model": settings["config"],
        "load_format": "weightstream",
        "model_loader_extra_config": {"target": settings.get("engine_target") or settings["target"]},
        "weight_transfer_config": WeightTransferConfig(backend="weightstream"),
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 256,
        "seed": 0,
    }


def greedy() -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class OfflineEngine:
    """An offline vLLM LLM in this process, driven through our OfflineLLMClient."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from vllm import LLM

        from weightstream.client.vllm_transfer import OfflineLLMClient

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.llm = LLM(**engine_args(settings))
        self.client = OfflineLLMClient(self.llm)

    def completions(self) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in self.llm.generate(PROMPTS, greedy(), use_tqdm=False)]

    def weight_version(self) -> str:
        return str(self.llm.get_weight_version())

    def close(self) -> None:
        pass


class RayEngine:
    """vLLM's LLM as an actor of a local Ray (one CPU, made as vLLM's RL examples make it: ray.remote(LLM)),
    driven through vLLM's RayVLLMWeightSyncClient."""

    def __init__(self, settings: dict[str, Any]) -> None:
        # Read when ray is imported, and inherited by every Ray process: without a cluster every Ray
        # server listens on loopback only (Ray's setting for one machine), and the token is this run's
        # own (Ray otherwise writes one to ~/.ray/auth_token).
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        import ray
        from vllm import LLM
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient

        ray.init(num_cpus=1, include_dashboard=False, _temp_dir=settings.get("ray_temp_dir"))
        self.handle = ray.remote(num_cpus=1)(LLM).remote(**engine_args(settings))
        self.client = RayVLLMWeightSyncClient(self.handle)

    def completions(self) -> list[list[int]]:
        import ray

        outputs = ray.get(self.handle.generate.remote(PROMPTS, greedy(), use_tqdm=False))
        return [list(o.outputs[0].token_ids) for o in outputs]

    def weight_version(self) -> str:
        import ray

        return str(ray.get(self.handle.get_weight_version.remote()))

    def close(self) -> None:
        import ray

        ray.kill(self.handle)
        ray.shutdown()


ENGINES = {"offline": OfflineEngine, "ray": RayEngine}


def train(rank: int, settings: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource

    world = int(settings["world_size"])
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(settings["config"])
    model = LlamaForCausalLM(config).to(torch.float32)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(settings["weights"]).glob("*.safetensors")):
        state.update(load_file(str(file)))
    model.load_state_dict(state)
    names = [name for name, _ in model.named_parameters()]

    class HalfSource(ModuleSource):
        """Every rank iterates the whole model; each holds (publishes) every other name."""

        def held_names(self) -> list[str]:
            return names[rank::world]

    source = HalfSource(model) if world > 1 else ModuleSource(model)
    local = ENGINES[settings["vllm"]](settings) if settings["vllm"] in ENGINES else None
    try:
        run_steps(rank, settings, model, config, source, local)
    finally:
        if local is not None:
            local.close()
    if world > 1:
        dist.destroy_process_group()


def run_steps(rank: int, settings: dict[str, Any], model: Any, config: Any, source: Any, local: Any) -> None:
    """The training loop, a send after each step; rank 0 prints RESULT and saves the trained weights."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from weightstream.client.vllm_transfer import WeightStreamTrainerInitInfo, WeightSyncError

    world = int(settings["world_size"])
    client = local.client if local is not None else HTTPVLLMWeightSyncClient(settings["vllm"])
    before = local.completions() if local is not None else None
    engine = WeightTransferTrainerFactory.trainer_init(
        WeightStreamTrainerInitInfo(
            target=settings["target"],
            model=settings["model"],
            engine_target=settings.get("engine_target"),
            transport=settings.get("transport", "auto"),
            deltas=settings.get("deltas", False),
            rank=rank,
            world_size=world,
        ),
        client=client,
        source=source,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(settings.get("lr", 0.05)))
    data = torch.Generator().manual_seed(100 + rank)
    steps: list[dict[str, Any]] = []
    # Sends at these steps (counted from 0) come without an optimizer step before them: nothing changed.
    unchanged = set(settings.get("unchanged", []))
    for index in range(int(settings["steps"])):
        record: dict[str, Any] = {}
        if index not in unchanged:
            batch = torch.randint(3, config.vocab_size, (4, 16), generator=data)
            loss = model(input_ids=batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            if world > 1:
                for param in model.parameters():
                    if param.grad is not None:
                        dist.all_reduce(param.grad)
                        param.grad /= world
            optimizer.step()
            record["loss"] = float(loss)
        try:
            engine.send_weights()
        except WeightSyncError as exc:
            record.update(revision=exc.revision, error=str(exc), phase=exc.phase)
        else:
            step = engine.last_step
            assert step is not None
            record.update(
                revision=step.revision,
                publish_seconds=step.publish_seconds,
                publish_bytes=step.publish_bytes,
                publish_sent_bytes=step.publish_sent_bytes,
                update_seconds=step.update_seconds,
                encoded=bool(engine.publisher.last_publish and engine.publisher.last_publish.encoded),
                delta_base=engine.publisher.last_publish.delta_base if engine.publisher.last_publish else "",
                host_copy=bool(engine.publisher.last_publish and engine.publisher.last_publish.host_copy),
            )
        if world > 1:
            dist.barrier()
        if rank == 0:
            if local is not None:
                record.update(tokens=local.completions(), weight_version=local.weight_version())
            else:
                record["tokens"] = completions(settings["vllm"], settings["served_model"])
        steps.append(record)
    engine.shutdown()
    if rank == 0:
        out = Path(settings["out"])
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(out / "model.safetensors"))
        print("RESULT " + json.dumps({"steps": steps, "before": before}), flush=True)


def main() -> None:
    settings = json.loads(sys.argv[1])
    world = int(settings["world_size"])
    if world == 1:
        train(0, settings)
        return
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(settings["master_port"]))
    mp.spawn(train, args=(settings,), nprocs=world, join=True)


if __name__ == "__main__":
    main()
