"""A transformers Llama, saved as 3 shards with an index, loaded over gRPC into a fresh model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.support.checkpoints import llama_config, load_folder
from weightstream.client import WeightStreamClient
from weightstream.samples import save_sharded

MODEL = "tiny-llama"


def test_three_shards_with_index(tiny_llama_folder: Path, client: WeightStreamClient) -> None:
    manifest = client.manifest(MODEL)
    assert len(manifest.files) == 3
    assert (tiny_llama_folder / "model.safetensors.index.json").exists()
    reference = load_folder(tiny_llama_folder)
    assert {t.name for t in manifest.tensors} == set(reference)
    assert manifest.total_bytes == sum(t.numel() * t.element_size() for t in reference.values())


def test_load_into_fresh_model_is_bit_identical_and_gives_same_logits(
    tiny_llama_folder: Path, client: WeightStreamClient
) -> None:
    reference = load_folder(tiny_llama_folder)
    torch.manual_seed(99)  # different random init, so a no-op load cannot pass
    model = transformers.LlamaForCausalLM(llama_config()).eval()
    assert not torch.equal(model.lm_head.weight, reference["lm_head.weight"])

    report = client.load_into(model, MODEL)

    assert report.tensors == len(reference)
    assert report.bytes == sum(t.numel() * t.element_size() for t in reference.values())
    assert report.missing == [] and report.unexpected == []
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor.view(torch.uint8), reference[name].view(torch.uint8)), name

    local = transformers.LlamaForCausalLM(llama_config()).eval()
    local.load_state_dict(reference)
    tokens = torch.tensor([[1, 17, 42, 7, 300, 5, 11, 2]])
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, local(tokens).logits)


def test_load_into_meta_model_materialised_with_to_empty(tiny_llama_folder: Path, client: WeightStreamClient) -> None:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config())
    model.to_empty(device="cpu")
    client.load_into(model, MODEL)
    reference = load_folder(tiny_llama_folder)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor.view(torch.uint8), reference[name].view(torch.uint8)), name


def test_meta_model_without_to_empty_is_refused_untouched(tiny_llama_folder: Path, client: WeightStreamClient) -> None:
    from weightstream.client import IncompatibleModuleError

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config())
    with pytest.raises(IncompatibleModuleError, match="meta device") as info:
        client.load_into(model, MODEL)
    assert info.value.partially_written is False


def test_iter_tensors_feeds_load_weights_style_consumers(tiny_llama_folder: Path, client: WeightStreamClient) -> None:
    reference = load_folder(tiny_llama_folder)
    model = transformers.LlamaForCausalLM(llama_config()).eval()
    params = dict(model.named_parameters())
    seen = []
    for name, tensor in client.iter_tensors(MODEL):
        seen.append(name)
        with torch.no_grad():
            params[name].copy_(tensor)
    assert sorted(seen) == sorted(reference)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name


def test_tied_weights_count_as_loaded(model_root: Path, client: WeightStreamClient) -> None:
    """A checkpoint that stores a tied weight once (as save_pretrained does) loads strictly into the tied model."""
    config = llama_config()
    config.tie_word_embeddings = True
    torch.manual_seed(7)
    source = transformers.LlamaForCausalLM(config).eval()
    assert source.lm_head.weight.data_ptr() == source.model.embed_tokens.weight.data_ptr()
    state = {k: v.contiguous() for k, v in source.state_dict().items() if k != "lm_head.weight"}
    save_sharded(state, model_root / "tied-llama", shards=1)

    torch.manual_seed(8)
    model = transformers.LlamaForCausalLM(config).eval()
    report = client.load_into(model, "tied-llama")
    assert report.missing == [] and report.unexpected == []
    expected = load_folder(model_root / "tied-llama")["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight, expected)
