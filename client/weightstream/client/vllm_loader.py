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
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from weightstream.client.facade import WeightStreamClient
from weightstream.client.loader_plan import plan_loads
from weightstream.client.options import MODEL_ENV, TARGET_ENV, ClientOptions
from weightstream.protocol import names
from weightstream.protocol.names import TransportChoice
from weightstream.protocol.wire import TensorSlice

# A child of vLLM's logger, so that these lines reach vLLM's handler and format (vLLM configures
# only the "vllm" logger; a weightstream.* logger would be dropped at the root's WARNING level).
logger = logging.getLogger("vllm.weightstream")

LOAD_FORMAT = "weightstream"
# WeightTransferConfig(backend=...) of the weight-transfer engine (vllm_transfer).
TRANSFER_BACKEND = "weightstream"


@dataclass(frozen=True)
class Loaded:
    """What a vLLM model last received from weightstream: the model id, its revision, and the slice of
    each checkpoint tensor that this rank's loaders read (None: all of it), as this loader planned them."""

    model: str
    revision: str
    slices: Mapping[str, TensorSlice | None]


# Each vLLM model's Loaded (this loader's load, then each update of vllm_transfer), so that an update
# asks only for what changed since, and only this rank's slices of it.
LOADED: weakref.WeakKeyDictionary[nn.Module, Loaded] = weakref.WeakKeyDictionary()
_KEYS = frozenset({"target", "model", "token", "tls", "ca_file", "shm_dir", "transport"})
# Parameters built from a quantization config, never read from a checkpoint (as in vLLM's own check).
_CONFIG_BUILT_PARAMS = ("input_scale_ub",)


@dataclass(frozen=True, kw_only=True)
class LoaderSettings:
    """Where the loader streams from, resolved once from the extra config and the environment."""

    target: str
    model: str
    token: str | None = None
    tls: bool = False
    ca_file: str | None = None
    shm_dir: str | None = None
    transport: TransportChoice = "auto"

    @classmethod
    def resolve(
        cls, extra: Mapping[str, object], model_path: str, environ: Mapping[str, str] | None = None
    ) -> LoaderSettings:
        """Settings from model_loader_extra_config, falling back to WEIGHTSTREAM_* variables and vLLM's model path."""
        options = ClientOptions.from_environ(environ)
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise ValueError(
                f"model_loader_extra_config for load_format={LOAD_FORMAT!r} has unknown keys {unknown}; "
                f"known: {sorted(_KEYS)}"
            )
        target = _text(extra, "target") or options.target
        if not target:
            raise ValueError(
                f"load_format={LOAD_FORMAT!r} needs the server's address: model_loader_extra_config "
                f'{{"target": "HOST:PORT"}} or the environment variable {TARGET_ENV}'
            )
        model = _text(extra, "model") or options.model or Path(model_path).name
        if not model:
            raise ValueError(f"no weightstream model id: set model_loader_extra_config['model'] or {MODEL_ENV}")
        token = _text(extra, "token") or options.token
        transport = _text(extra, "transport") or "auto"
        if transport not in names.TRANSPORTS:
            raise ValueError(
                f"model_loader_extra_config['transport'] must be one of {names.TRANSPORTS}, not {transport!r}"
            )
        shm_dir = _text(extra, "shm_dir") or (str(options.shm_dir) if options.shm_dir else None)
        return cls(
            target=target,
            model=model,
            token=token,
            tls=_flag(extra, "tls"),
            ca_file=_text(extra, "ca_file"),
            shm_dir=shm_dir,
            transport=transport,
        )


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
        device = _parameter_device(model)
        started = time.perf_counter()
        with WeightStreamClient(
            settings.target,
            token=settings.token,
            tls=settings.tls,
            ca_file=settings.ca_file,
            progress=self.load_config.use_tqdm_on_load,
            transport=settings.transport,
            shm_dir=settings.shm_dir,
        ) as client:
            manifest = client.manifest(settings.model)
            connected = time.perf_counter() - started
            plan = plan_loads(load_model_weights, model, manifest)
            planned = time.perf_counter() - started - connected
            if plan.fallback:
                logger.info(
                    "weightstream: %d tensors of %s are streamed whole to %s.load_weights: %s",
                    len(plan.fallback),
                    settings.model,
                    type(model).__name__,
                    "; ".join(f"{name}: {why}" for name, why in plan.fallback.items()),
                )
            report = client.load_targets(settings.model, plan.targets, manifest=manifest)
            loaded_bytes = report.bytes
            loaded = set(plan.loaded)
            reported = plan.reports_loaded
            if plan.fallback:

                def counted(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
                    nonlocal loaded_bytes
                    for name, tensor in weights:
                        loaded_bytes += tensor.numel() * tensor.element_size()
                        yield name, tensor

                names = load_model_weights(
                    counted(client.iter_tensors(settings.model, names=plan.fallback, device=device))
                )
                reported = reported and names is not None
                loaded |= set(names or ())
        LOADED[model] = Loaded(settings.model, manifest.revision, {n: t.slice for n, t in plan.targets.items()})
        seconds = time.perf_counter() - started
        logger.info(
            "weightstream: loaded %s from %s: %d bytes in %.3f s (%.2f GB/s); %d tensors written in place, "
            "%d streamed whole, %d unused; connected and manifest in %.3f s, planned in %.3f s, "
            "written in place in %.3f s; transport %s",
            settings.model,
            settings.target,
            loaded_bytes,
            seconds,
            loaded_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            len(plan.targets),
            len(plan.fallback),
            len(plan.unused),
            connected,
            planned,
            report.seconds,
            report.transport,
        )
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


def _parameter_device(model: nn.Module) -> torch.device:
    """Where model's parameters live (vLLM builds them on the load device); tensors are streamed there."""
    for param in model.parameters():
        if param.device.type in ("cpu", "cuda"):
            return param.device
    return torch.device("cpu")


def _text(extra: Mapping[str, object], key: str) -> str | None:
    value = extra.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"model_loader_extra_config[{key!r}] must be a string, not {type(value).__name__}")
    return value.strip() or None


def _flag(extra: Mapping[str, object], key: str) -> bool:
    value = extra.get(key, False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "0", "false", "no", ""):
        return value.strip().lower() in ("1", "true", "yes")
    raise ValueError(f"model_loader_extra_config[{key!r}] must be true or false, not {value!r}")
