"""The transformers recipe of docs/how-to/transformers.md, run as written: meta-device model, load_into from the
server, generate."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.support.checkpoints import llama_config, load_folder
from weightstream.client import WeightStreamClient


def test_meta_model_loaded_over_grpc_generates_like_a_local_load(tiny_llama_folder: Path, target: str) -> None:
    config = llama_config()
    prompt = torch.tensor([[1, 2, 3, 4, 5]])

    # --- the recipe, as in docs/how-to/transformers.md ---
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.to_empty(device="cpu")
    for module in model.modules():  # non-persistent buffers (rotary inv_freq) are not in checkpoints:
        if "RotaryEmbedding" in type(module).__name__:  # recompute them from the config
            model._init_weights(module)
    with WeightStreamClient(target) as client:
        client.load_into(model, "tiny-llama")
    tokens = model.eval().generate(prompt, max_new_tokens=12, do_sample=False)
    # --- end of the recipe ---

    local = transformers.LlamaForCausalLM(config).eval()
    local.load_state_dict(load_folder(tiny_llama_folder))
    expected = local.generate(prompt, max_new_tokens=12, do_sample=False)
    assert tokens.shape[1] == prompt.shape[1] + 12
    assert torch.equal(tokens, expected)
    with torch.no_grad():  # logits at every position: wrong rotary buffers would show here
        assert torch.equal(model(tokens).logits, local(tokens).logits)
