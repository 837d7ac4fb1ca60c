"""Small made-up checkpoints and the modules to load them into: the demo's, the benchmarks', the tests'.

Shipped with the client because `weightstream demo` (and the compose demo's upload job) make their
checkpoint with it; nothing here touches the network. Tensors are random, from a seeded generator,
so a checkpoint is the same on every machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def llama_like_state_dict(
    *, layers: int = 4, hidden: int = 512, intermediate: int = 1408, vocab: int = 8192, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random bfloat16 tensors named and shaped like a small Llama checkpoint."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    state = {"model.embed_tokens.weight": rand(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = rand(hidden)
        state[p + "post_attention_layernorm.weight"] = rand(hidden)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[p + f"self_attn.{name}.weight"] = rand(hidden, hidden)
        state[p + "mlp.gate_proj.weight"] = rand(intermediate, hidden)
        state[p + "mlp.up_proj.weight"] = rand(intermediate, hidden)
        state[p + "mlp.down_proj.weight"] = rand(hidden, intermediate)
    state["model.norm.weight"] = rand(hidden)
    state["lm_head.weight"] = rand(vocab, hidden)
    return state


def save_sharded(state: dict[str, torch.Tensor], folder: Path, shards: int) -> None:
    """Save state as `shards` safetensors files plus a model.safetensors.index.json."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    names = list(state)
    per_shard = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[i * per_shard : (i + 1) * per_shard]}
        save_file(part, str(folder / file_name))
        weight_map.update(dict.fromkeys(part, file_name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


class ParameterTree(torch.nn.Module):
    """A module whose parameters have given names and shapes (dots make submodules)."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        super().__init__()
        for name, (shape, dtype) in shapes.items():
            owner: torch.nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False))
