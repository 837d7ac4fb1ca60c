"""Run in the vLLM environment (.venv-vllm), not under pytest: checks of the loader that need no engine.

Usage: python tests/support/vllm_scripts/loader_checks.py TARGET MODEL

Each check raises on failure; the script prints `ok` when all pass. The model handed to the loader
in the last check is a small torch module with a vLLM-style load_weights, and its model config is a
stand-in with the two fields the loader reads: a vLLM model that misses a weight cannot be built
from a checkpoint that has them all, and an engine run per check would take half a minute each.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import nn


def main() -> None:
    target, model_id = sys.argv[1], sys.argv[2]

    import weightstream.client

    assert "vllm" not in sys.modules, "import weightstream.client imported vllm"

    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # through the entry point, as every vLLM process does
    from weightstream.client.vllm_loader import LoaderSettings, WeightStreamModelLoader, weights_not_loaded

    loader = get_model_loader(LoadConfig(load_format="weightstream", model_loader_extra_config={"target": target}))
    assert type(loader) is WeightStreamModelLoader, type(loader)

    settings = LoaderSettings.resolve({"target": "a:1"}, "/configs/org/tiny-llama/", environ={})
    assert (settings.target, settings.model, settings.token, settings.tls) == ("a:1", "tiny-llama", None, False)
    env = {"WEIGHTSTREAM_TARGET": "b:2", "WEIGHTSTREAM_MODEL": "s3://bucket/m", "WEIGHTSTREAM_TOKEN": "t\n"}
    settings = LoaderSettings.resolve({}, "/configs/x", environ=env)
    assert (settings.target, settings.model, settings.token) == ("b:2", "s3://bucket/m", "t"), settings
    settings = LoaderSettings.resolve({"target": "c:3", "model": "m", "token": "k", "tls": True}, "/x", environ=env)
    assert (settings.target, settings.model, settings.token, settings.tls) == ("c:3", "m", "k", True), settings
    settings = LoaderSettings.resolve({"target": "a:1"}, "/x", environ={"WEIGHTSTREAM_SHM_DIR": "/dev/shm/ws"})
    assert (settings.shm_dir, settings.transport) == ("/dev/shm/ws", "auto"), settings
    settings = LoaderSettings.resolve({"target": "a:1", "shm_dir": "/s", "transport": "grpc"}, "/x", environ={})
    assert (settings.shm_dir, settings.transport) == ("/s", "grpc"), settings
    assert LoaderSettings.resolve({"target": "a:1", "transport": "tcp"}, "/x", environ={}).transport == "tcp"
    for extra, message in (
        ({}, "WEIGHTSTREAM_TARGET"),
        ({"target": "a:1", "tagret": 1}, "unknown keys"),
        ({"target": "a:1", "transport": "udp"}, "must be one of ('auto', 'grpc', 'shm', 'tcp'), not 'udp'"),
    ):
        try:
            LoaderSettings.resolve(extra, "/x", environ={})
        except ValueError as exc:
            assert message in str(exc), exc
        else:
            raise AssertionError(f"{extra} was accepted")

    class Partial(nn.Module):
        """The served model's tensors plus one parameter no checkpoint has; load_weights like vLLM's models."""

        def __init__(self, shapes: dict[str, torch.Size]) -> None:
            super().__init__()
            self.weights = nn.ParameterDict(
                {n.replace(".", "__"): nn.Parameter(torch.empty(s)) for n, s in shapes.items()}
            )
            self.extra = nn.Linear(2, 2)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            loaded = set()
            for name, tensor in weights:
                self.weights[name.replace(".", "__")].data.copy_(tensor)
                loaded.add("weights." + name.replace(".", "__"))
            return loaded

    with weightstream.client.WeightStreamClient(target, progress=False) as client:
        shapes = {t.name: torch.Size(t.shape) for t in client.manifest(model_id).tensors}
    module = Partial(shapes)
    assert weights_not_loaded(module, {f"weights.{n.replace('.', '__')}" for n in shapes}, quantized=False) == {
        "extra.weight",
        "extra.bias",
    }
    try:
        loader.load_weights(module, SimpleNamespace(model=f"/configs/{model_id}", quantization=None))
    except ValueError as exc:
        assert "left 2 parameters of Partial unloaded: ['extra.bias', 'extra.weight']" in str(exc), exc
        assert model_id in str(exc) and target in str(exc), exc
    else:
        raise AssertionError("a model with unloaded parameters was accepted")
    print("ok")


if __name__ == "__main__":
    main()
