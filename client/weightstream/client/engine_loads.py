"""An engine's first load from a weightstream server, through the model's own `load_weights`.

Shared by the vLLM loader (vllm_loader) and the SGLang loader (sglang_loader); this module imports
neither engine. stream_weights() plans the load with loader_plan.plan_loads (which slice of each
checkpoint tensor this rank's loaders read, and which parameter views they write), has the server
send exactly those slices into those views, streams the tensors that cannot be planned whole
through load_weights, and records what the model now holds in engine_updates.LOADED.

One thread; the model must not be used meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from weightstream.client.engine_updates import LOADED, Loaded, parameter_device
from weightstream.client.errors import IncompatibleModuleError
from weightstream.client.facade import LoadReport
from weightstream.client.loader_plan import LoadPlan, LoadWeights, plan_loads
from weightstream.client.loader_settings import LoaderSettings
from weightstream.client.manifest import Manifest


@dataclass(frozen=True)
class StreamedLoad:
    """What stream_weights did: the manifest loaded, its plan, the in-place report, and the names
    load_weights reported loaded (reported: False once a call returned None instead of names)."""

    manifest: Manifest
    plan: LoadPlan
    report: LoadReport
    loaded: set[str]
    reported: bool
    loaded_bytes: int
    seconds: float


def stream_weights(
    load_model_weights: LoadWeights,
    model: nn.Module,
    settings: LoaderSettings,
    *,
    progress: bool,
    logger: logging.Logger,
    check: Callable[[Manifest, LoadPlan], None] | None = None,
) -> StreamedLoad:
    """Load settings.model from settings.target into model through load_model_weights; see the module doc.
    check: called with the manifest and the plan before any byte is written (raises to refuse them)."""
    device = parameter_device(model)
    started = time.perf_counter()
    with settings.client(progress=progress) as client:
        manifest = client.manifest(settings.model)
        connected = time.perf_counter() - started
        plan = plan_loads(load_model_weights, model, manifest)
        planned = time.perf_counter() - started - connected
        if check is not None:
            check(manifest, plan)
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

            names = load_model_weights(counted(client.iter_tensors(settings.model, names=plan.fallback, device=device)))
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
    return StreamedLoad(manifest, plan, report, loaded, reported, loaded_bytes, seconds)


def check_slices(manifest: Manifest, plan: LoadPlan, tp_size: int) -> None:
    """Refuse checkpoint tensors larger than the model's parameters: SGLang's weight loaders narrow each
    tensor to the rank's share of the parameter, so a wider checkpoint would be cut silently. The ranks'
    slices together must cover a tensor's split dimension (with replicated or padded shares, more)."""
    cut = []
    for name, target in plan.targets.items():
        piece = target.slice
        if piece is None:
            continue
        size = manifest[name].shape[piece.dim]
        if (piece.stop - piece.start) * tp_size < size:
            cut.append(f"{name} {list(manifest[name].shape)} (the model takes {piece.stop - piece.start} of {size})")
    if cut:
        raise IncompatibleModuleError(
            f"weightstream model {manifest.model!r} does not fit the engine's model: {len(cut)} tensors are larger "
            f"than its parameters at tensor-parallel size {tp_size}: " + "; ".join(cut[:10])
        )
