"""A vLLM model loader, `load_format="weightstream"`: the weights come from a weightstream server.

vLLM finds it through the `vllm.general_plugins` entry point `weightstream`, which calls register()
in every vLLM process (the engine and each worker); registering in the user's process alone would
not reach the workers. This module imports vLLM, so nothing but that entry point imports it:
`import weightstream.client` stays free of vLLM.

Configuration is `model_loader_extra_config` (`--model-loader-extra-config` on `vllm serve`)::

    LLM(model="/configs/tiny-llama", load_format="weightstream",
        model_loader_extra_config={"target": "weights:50051", "token": "...", "tls": True})

| key       | env fallback           | meaning                                                         |
|-----------|------------------------|-----------------------------------------------------------------|
| target    | WEIGHTSTREAM_TARGET    | HOST:PORT of the weightstream server (required)                 |
| model     | WEIGHTSTREAM_MODEL     | model id on the server; default: the last component of `model`  |
| token     | WEIGHTSTREAM_TOKEN     | bearer token                                                    |
| tls       |                        | connect over TLS (default false)                                |
| ca_file   |                        | PEM CA bundle for TLS (default: the system's roots)             |
| shm_dir   | WEIGHTSTREAM_SHM_DIR   | shared-memory directory the server also sees (same pod or host) |
| transport |                        | "auto" (default: shm, else tcp, else grpc), "shm", "tcp", "grpc"|
| retry_deadline |                   | seconds a server not up yet (or an outage) is retried; 300      |

vLLM's `model` folder then holds only config.json and the tokenizer: no weights are downloaded
or staged on disk. Each rank receives only its own bytes: loader_plan.plan_loads runs the model's
own `load_weights` once per checkpoint tensor over a placeholder of no memory and records which
slice of the tensor vLLM's weight loaders read and which parameter views they write (fused qkv
and gate_up blocks, row-parallel columns, the padded vocabulary, replicated key/value heads all
come out of vLLM itself), and the server then sends exactly those slices, written straight into
those views (converted on that copy when the checkpoint's dtype is not the parameter's). A tensor
whose loader does more than narrow and copy is streamed whole and handed to `load_weights`, and
the log says which. Afterwards every parameter must have been reported loaded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping

from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from weightstream.client.engine_loads import stream_weights
from weightstream.client.loader_settings import LOAD_FORMAT, LoaderSettings

# A child of vLLM's logger, so that these lines reach vLLM's handler and format (vLLM configures
# only the "vllm" logger; a weightstream.* logger would be dropped at the root's WARNING level).
logger = logging.getLogger("vllm.weightstream")

# WeightTransferConfig(backend=...) of the weight-transfer engine (vllm_transfer).
TRANSFER_BACKEND = "weightstream"


# Parameters built from a quantization config, never read from a checkpoint (as in vLLM's own check).
_CONFIG_BUILT_PARAMS = ("input_scale_ub",)


class WeightStreamModelLoader(BaseModelLoader):
    """Loads a vLLM model's weights from a weightstream server instead of local files."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        extra = load_config.model_loader_extra_config
        if not isinstance(extra, Mapping):
            raise ValueError(f"model_loader_extra_config must be a dict for load_format={LOAD_FORMAT!r}")
        self._extra: Mapping[str, object] = extra

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the weights are streamed by load_weights."""

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        settings = LoaderSettings.resolve(self._extra, model_config.model)
        load_model_weights = getattr(model, "load_weights", None)
        if not callable(load_model_weights):
            raise ValueError(f"{type(model).__name__} has no load_weights(weights) method, which vLLM's models have")
        streamed = stream_weights(
            load_model_weights, model, settings, progress=self.load_config.use_tqdm_on_load, logger=logger
        )
        loaded, reported = streamed.loaded, streamed.reported
        if not reported:
            logger.warning(
                "weightstream: %s.load_weights returned no names; cannot check that every weight was loaded",
                type(model).__name__,
            )
            return
        missing = weights_not_loaded(model, loaded, quantized=model_config.quantization is not None)
        if missing:
            raise ValueError(
                f"weightstream model {settings.model!r} from {settings.target} left {len(missing)} parameters of "
                f"{type(model).__name__} unloaded: {sorted(missing)}"
            )


def weights_not_loaded(model: nn.Module, loaded: set[str], *, quantized: bool) -> set[str]:
    """The parameters of model that load_weights did not report as loaded.

    Stricter than vLLM's DefaultModelLoader, which on unquantized models exempts every module that
    has a quantization method (every linear layer): here only parameters that a checkpoint cannot
    carry are exempt: those of online quantization (quantized while loading), KV-cache scales of a
    quantized model (defaults when absent), empty placeholders and parameters built from the config.
    """
    expected = {name for name, _ in model.named_parameters()}
    exempt: set[str] = set()
    for module_name, module in model.named_modules():
        quant_method = getattr(module, "quant_method", None)
        online = bool(getattr(quant_method, "uses_meta_device", False))
        kv_scales = quantized and isinstance(quant_method, BaseKVCacheMethod)
        for param_name, param in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            if online or kv_scales or param.numel() == 0 or (quantized and param_name in _CONFIG_BUILT_PARAMS):
                exempt.add(full_name)
    return expected - loaded - exempt


def register() -> None:
    """The `vllm.general_plugins` entry point: makes load_format="weightstream" and the weight-transfer
    backend "weightstream" known to this process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    with contextlib.suppress(ValueError):  # registered already in this process
        WeightTransferEngineFactory.register_engine(
            TRANSFER_BACKEND, "weightstream.client.vllm_transfer", "WeightStreamWeightTransferEngine"
        )
    register_trainer()

    # vLLM loads plugins once per process, but a user may also call this; a second registration
    # would only log vLLM's "already registered" warning.
    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not WeightStreamModelLoader:
        register_model_loader(LOAD_FORMAT)(WeightStreamModelLoader)


def register_trainer() -> None:
    """Make the trainer-side backend "weightstream" known to vLLM's WeightTransferTrainerFactory here."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    with contextlib.suppress(ValueError):  # registered already in this process
        WeightTransferTrainerFactory.register_engine(
            TRANSFER_BACKEND, "weightstream.client.vllm_trainer", "WeightStreamTrainerEngine"
        )
