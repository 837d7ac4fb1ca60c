"""An SGLang model loader, `load_format="weightstream"`: the weights come from a weightstream server,
at start-up and in every in-place update through SGLang's own update path.

SGLang finds it through the `sglang.srt.plugins` entry point `weightstream`, which calls register()
in every SGLang process (the launcher, the detokenizer, each scheduler; the weights load in the
schedulers). register() hooks one point: SGLang's load formats are a closed enum checked in
LoadConfig._verify_load_format, and an AROUND hook there turns "weightstream" into this loader
class, which SGLang's get_model_loader then builds; it also adds "weightstream" to the CLI's
--load-format choices. This module imports SGLang, so nothing but that entry point imports it:
`import weightstream.client` stays free of SGLang.

Configuration is `model_loader_extra_config` (`--model-loader-extra-config` on launch_server), with
the vLLM loader's keys (loader_settings: target, model, token, tls, ca_file, shm_dir, transport,
retry_deadline) plus `deltas` (keep a host copy of the rank's slices and update it with XOR deltas;
costs host memory of the rank's share of the checkpoint; off by default)::

    sglang.Engine(model_path="/configs/tiny-llama", load_format="weightstream",
                  model_loader_extra_config={"target": "weights:50051"})

Start-up: the model is built as SGLang's DefaultModelLoader builds it, then engine_loads streams
exactly the slices this rank's weight loaders read into the parameter views they write (found by
running the model's own load_weights over placeholders), the rest whole through load_weights, and
SGLang's post-load processing runs. A server that cannot be reached (within retry_deadline), a
model id it does not serve, a checkpoint whose tensors do not fit the model, or a model parameter
no checkpoint tensor writes: the start fails with an error that says which.

Updates: SGLang's update_weights_from_disk (Engine method, POST /update_weights_from_disk) pauses
generation, builds a loader for the request's load_format, asks it for a weight iterator of the
request's model_path and hands that to load_weights_and_postprocess, then flushes the cache; on a
failure there it asks the same loader again, to restore what it held. With load_format
"weightstream" the model_path names the revision (update_path(), "weightstream:REVISION"; any other
path: the server's current revision), and this loader pulls only the tensors that changed since
the revision the model holds (plus those fused with them into one parameter, but for the parts
SGLang writes into their own rows of an unquantized one: sglang_packed), only this rank's slices of
them, into host memory first, and checks their names, shapes and dtypes against what the model
holds before the first byte is written; a failure up to there leaves every weight as it was. The restore call
re-sends, at the held revision, the tensors that a failed write may have touched.

One update at a time per model (SGLang's scheduler runs them one by one).
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.configs.device_config import DeviceConfig
from sglang.srt.configs.load_config import LoadConfig
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.loader import (
    BaseModelLoader,
    DefaultModelLoader,
    _get_quantization_config,
    _initialize_model,
)
from sglang.srt.model_loader.utils import set_default_torch_dtype
from torch import nn

from weightstream.client.engine_loads import check_slices, stream_weights
from weightstream.client.engine_updates import (
    LATEST,
    LOADED,
    HostCopy,
    Loaded,
    UpdatePlan,
    check_layout,
    full_shaped,
    packed_modules,
    plan_update,
)
from weightstream.client.errors import IncompatibleModuleError, WeightStreamError
from weightstream.client.facade import WeightStreamClient
from weightstream.client.loader_plan import LoadPlan
from weightstream.client.loader_settings import LOAD_FORMAT, LoaderSettings, flag
from weightstream.client.manifest import Manifest
from weightstream.client.sglang import revision_of_format

# Below SGLang's logger, whose root handler SGLang configures (Engine: log_level, default "error").
logger = logging.getLogger("sglang.weightstream")

# Where LoadConfig checks its load format, and where the CLI's --load-format choices are listed.
_VERIFY_TARGET = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"


@dataclass
class _Held:
    """What the update path needs of a model loaded by this loader: a client of its server, the
    checkpoint's layout (name -> dtype and shape) and, with deltas, the host copy."""

    settings: LoaderSettings
    client: WeightStreamClient
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    host_copy: HostCopy | None


_HELD: weakref.WeakKeyDictionary[nn.Module, _Held] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Pull:
    """The weight "iterator" this loader hands SGLang's update path: the revision to pull, read by
    load_weights_and_postprocess, which knows the model."""

    revision: str

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise TypeError(f"load_format={LOAD_FORMAT!r} weights are pulled by its load_weights_and_postprocess")


class WeightStreamModelLoader(DefaultModelLoader):
    """Loads an SGLang model's weights from a weightstream server, at start-up and on updates."""

    # The revision an update pulls (loader_for makes a subclass per revision named).
    revision: str = LATEST

    def __init__(self, load_config: LoadConfig) -> None:
        # Not DefaultModelLoader.__init__: it refuses every extra-config key but its own.
        BaseModelLoader.__init__(self, load_config)
        extra = load_config.model_loader_extra_config or {}
        if not isinstance(extra, Mapping):
            raise ValueError(f"model_loader_extra_config must be a dict for load_format={LOAD_FORMAT!r}")
        self._extra: dict[str, object] = {k: v for k, v in extra.items() if k != "deltas"}
        self._deltas = flag(extra, "deltas")
        # Of the update in progress: the tensors a failed write may have touched (for the restore call).
        self._pulls = 0
        self._touched: list[str] = []

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the weights are streamed by load_model."""

    def load_model(self, *, model_config: ModelConfig, device_config: DeviceConfig) -> nn.Module:
        settings = LoaderSettings.resolve(self._extra, model_config.model_path)
        target_device = torch.device(device_config.device)
        quant_config = _get_quantization_config(model_config, self.load_config)
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = _initialize_model(model_config, self.load_config, quant_config)
            load_model_weights = getattr(model, "load_weights", None)
            if not callable(load_model_weights):
                raise ValueError(f"{type(model).__name__} has no load_weights(weights) method, which SGLang's have")
            try:
                streamed = stream_weights(
                    load_model_weights, model, settings, progress=False, logger=logger, check=_check_slices
                )
            except WeightStreamError:
                raise
            except Exception as exc:  # the model's own loaders refused a tensor
                raise IncompatibleModuleError(
                    f"weightstream model {settings.model!r} from {settings.target} does not fit "
                    f"{type(model).__name__} of {model_config.model_path}: {exc}"
                ) from exc
            unwritten = parameters_not_written(model, streamed.plan)
            if unwritten:
                raise IncompatibleModuleError(
                    f"weightstream model {settings.model!r} from {settings.target} left {len(unwritten)} parameters "
                    f"of {type(model).__name__} unloaded (no checkpoint tensor writes them): {sorted(unwritten)[:20]}"
                )
            DefaultModelLoader.postprocess_weights(model, target_device)
        client = settings.client()
        held = _Held(
            settings,
            client,
            {t.name: (t.dtype, t.shape) for t in streamed.manifest.tensors},
            HostCopy(client, settings.model, LOADED[model].slices) if self._deltas else None,
        )
        # Tell the server which revision this engine holds: it keeps that revision's block CRC32Cs
        # from now on, so that the next update finds what changed even in rewritten files.
        client.changes(settings.model, since=streamed.manifest.revision, revision=streamed.manifest.revision)
        if held.host_copy is not None:
            held.host_copy.pull(streamed.manifest.revision, logger=logger)
        _HELD[model] = held
        self.counter_after_loading_weights = time.perf_counter()
        return model.eval()

    def _get_weights_iterator(self, source: DefaultModelLoader.Source, **_: Any) -> Any:
        """For SGLang's update path: which revision to pull (the work is done where the model is known)."""
        return _Pull(self.revision)

    def load_weights_and_postprocess(self, model: nn.Module, weights: Any, target_device: torch.device) -> None:
        """SGLang's update path: pull weights.revision into model (the first call), or restore what a
        failed pull may have touched (a second call on this loader)."""
        if not isinstance(weights, _Pull):
            raise TypeError(f"load_format={LOAD_FORMAT!r} takes no filtered weight iterator")
        held = _HELD.get(model)
        loaded = LOADED.get(model)
        if held is None or loaded is None:
            raise ValueError(
                f"load_format={LOAD_FORMAT!r} updates a model that it loaded at start-up; this one was loaded "
                "with another load format"
            )
        self._pulls += 1
        if self._pulls == 1:
            self._pull(model, held, loaded, weights.revision, target_device)
        else:
            self._restore(model, held, loaded, target_device)

    def _pull(self, model: nn.Module, held: _Held, loaded: Loaded, revision: str, device: torch.device) -> None:
        started = time.perf_counter()
        settings = held.settings
        try:
            plan = plan_update(held.client, settings.model, loaded, revision, sglang_packed(model), logger=logger)
            check_layout(plan.manifest.tensors, held.layout, settings.model, plan.manifest.revision)
            if held.host_copy is not None:
                held.host_copy.pull(plan.manifest.revision, logger=logger)
                received: Iterable[tuple[str, torch.Tensor]] = held.host_copy.tensors(plan.names, device)
            else:
                # Into memory first: a failure while receiving must leave the model as it was.
                received = list(
                    held.client.iter_tensors(
                        settings.model,
                        names=plan.names,
                        device=device,
                        slices=plan.slices,
                        revision=plan.manifest.revision,
                    )
                )
        except Exception as exc:
            raise RuntimeError(
                f"weightstream: pulling {revision!r} of {settings.model} from {settings.target} failed, nothing "
                f"was written; the engine still serves {loaded.revision}: {type(exc).__name__}: {exc}"
            ) from exc
        self._touched = list(plan.names)
        try:
            DefaultModelLoader.load_weights_and_postprocess(model, full_shaped(received, plan), device)
        except Exception as exc:
            raise RuntimeError(
                f"weightstream: writing {plan.manifest.revision} of {settings.model} into "
                f"{type(model).__name__} failed; restoring {loaded.revision}: {type(exc).__name__}: {exc}"
            ) from exc
        LOADED[model] = Loaded(settings.model, plan.manifest.revision, loaded.slices)
        self._touched = []
        seconds = time.perf_counter() - started
        logger.info(
            "weightstream: updated %s from %s to %s: %d tensors, %d bytes in %.3f s (%.2f GB/s) from %s",
            settings.model,
            plan.since or "(unknown)",
            plan.manifest.revision,
            len(plan.names),
            plan.nbytes,
            seconds,
            plan.nbytes / seconds / 1e9 if seconds > 0 else 0.0,
            settings.target,
        )

    def _restore(self, model: nn.Module, held: _Held, loaded: Loaded, device: torch.device) -> None:
        names, self._touched = self._touched, []
        if not names:
            DefaultModelLoader.postprocess_weights(model, device)
            logger.info("weightstream: nothing was written; %s still holds %s", held.settings.model, loaded.revision)
            return
        slices = {n: s for n in names if (s := loaded.slices.get(n)) is not None}
        manifest = held.client.manifest(held.settings.model, revision=loaded.revision)
        plan = UpdatePlan(manifest, loaded.revision, names, slices, 0)
        received = held.client.iter_tensors(
            held.settings.model, names=names, device=device, slices=slices, revision=manifest.revision
        )
        DefaultModelLoader.load_weights_and_postprocess(model, full_shaped(received, plan), device)
        logger.warning(
            "weightstream: restored %d tensors of %s at %s", len(names), held.settings.model, loaded.revision
        )


def sglang_packed(model: nn.Module) -> dict[str, list[str]]:
    """The model's fused parameters that an update rebuilds from all of their checkpoint parts, and
    those parts ({"qkv_proj": ["q_proj", "k_proj", "v_proj"]}): a change to one part sends them all.

    The fused parameters come from packed_modules_mapping where the model has one, else its
    bitsandbytes_stacked_params_mapping ({".q_proj": (".qkv_proj", 0), ...}). A part is sent alone
    only where that is known to be right (_written_part_by_part); anywhere else, all parts are.
    """
    packed = packed_modules(model)
    stacked = getattr(model, "bitsandbytes_stacked_params_mapping", None)
    if not packed and isinstance(stacked, dict):
        for part, (fused, _) in sorted(stacked.items(), key=lambda item: (item[1][0], item[1][1])):
            packed.setdefault(fused.strip("."), []).append(part.strip("."))
    if _has_experts(model):
        return packed
    return {fused: parts for fused, parts in packed.items() if not _written_part_by_part(model, fused)}


def _written_part_by_part(model: nn.Module, fused: str) -> bool:
    """Whether every module of model named fused is a QKVParallelLinear or MergedColumnParallelLinear
    with SGLang's UnquantizedLinearMethod, not repacked for AMX: its weight loader writes each part into
    its own rows of the fused parameter and its processing after loading leaves them as written, so
    the parts that did not change stay in place. Not so elsewhere: a quantized layer's processing
    rebuilds the parameter from all parts, and other fused layers (DeepSeek's ReplicatedLinear
    fused_qkv_a_proj_with_mqa, whose load_weights waits for both parts in one call) need every part."""
    from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    modules = [m for name, m in model.named_modules() if name == fused or name.endswith("." + fused)]
    return bool(modules) and all(
        isinstance(m, (QKVParallelLinear, MergedColumnParallelLinear))
        and type(getattr(m, "quant_method", None)) is UnquantizedLinearMethod
        and not getattr(m, "use_intel_amx_backend", False)
        for m in modules
    )


def _has_experts(model: nn.Module) -> bool:
    """Whether model has mixture-of-experts layers (whose experts' gate and up parts land in one w13
    parameter per layer, processed after loading as a whole): then every fused part is sent."""
    return any(hasattr(m, "w13_weight") for m in model.modules())


def _check_slices(manifest: Manifest, plan: LoadPlan) -> None:
    from sglang.srt.distributed.parallel_state import get_tensor_model_parallel_world_size

    check_slices(manifest, plan, get_tensor_model_parallel_world_size())


def parameters_not_written(model: nn.Module, plan: LoadPlan) -> set[str]:
    """The parameters no planned write reaches (empty when some tensors were streamed whole through
    load_weights, which says nothing of where they went)."""
    if plan.fallback:
        return set()
    written = {view.untyped_storage().data_ptr() for target in plan.targets.values() for view in target.views}
    return {
        name
        for name, param in model.named_parameters()
        if param.numel() and param.untyped_storage().data_ptr() not in written
    }


@functools.lru_cache(maxsize=64)
def loader_for(revision: str) -> type[WeightStreamModelLoader]:
    """The loader class whose updates pull revision."""
    if revision == LATEST:
        return WeightStreamModelLoader
    return type("WeightStreamModelLoader", (WeightStreamModelLoader,), {"revision": revision})


def _verify_load_format(original: Any, config: LoadConfig, *args: Any, **kwargs: Any) -> Any:
    """AROUND LoadConfig._verify_load_format: "weightstream" (an update's "weightstream:REVISION")
    becomes this loader class."""
    revision = revision_of_format(config.load_format) if isinstance(config.load_format, str) else None
    if revision is None:
        return original(config, *args, **kwargs)
    config.load_format = loader_for(revision)
    return None


def register() -> None:
    """The `sglang.srt.plugins` entry point: makes load_format="weightstream" known to this process."""
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _registered
    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    # SGLang loads plugins once per process, but a user may also call this: one hook is enough.
    if not _registered:
        HookRegistry.register(_VERIFY_TARGET, _verify_load_format, HookType.AROUND)
        _registered = True


_registered = False


__all__ = ["WeightStreamModelLoader", "loader_for", "register"]
