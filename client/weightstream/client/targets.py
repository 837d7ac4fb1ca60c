"""Matching a checkpoint's tensors to a module's parameters and buffers, before any byte is written."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from weightstream.client.errors import IncompatibleModuleError
from weightstream.client.manifest import Manifest

_SHOWN = 5


@dataclass(frozen=True)
class TargetMatch:
    """The module tensors to write, by checkpoint name, and what did not match."""

    targets: dict[str, torch.Tensor]
    missing: list[str]
    unexpected: list[str]


def match_targets(
    module: torch.nn.Module | Mapping[str, torch.Tensor], manifest: Manifest, *, strict: bool
) -> TargetMatch:
    """Check names, shapes and dtypes of module against manifest; raise before anything is written.

    The module's tensors are its state_dict entries (parameters and persistent buffers), or the
    tensors of a mapping by name. Names that share storage (tied weights) count as loaded when any
    of them is in the checkpoint.
    """
    state = module.state_dict(keep_vars=True) if isinstance(module, torch.nn.Module) else dict(module)
    loadable = {name: tensor for name, tensor in state.items() if name in manifest}
    unexpected = sorted(name for name in manifest.by_name if name not in state)

    problems = []
    for name, tensor in loadable.items():
        info = manifest[name]
        if tensor.dtype != info.dtype or tuple(tensor.shape) != info.shape:
            problems.append(
                f"tensor {name!r}: checkpoint has {info.dtype} {list(info.shape)}, "
                f"module has {tensor.dtype} {list(tensor.shape)}"
            )
        elif tensor.device.type == "meta":
            problems.append(
                f"tensor {name!r} is on the meta device; materialise the module first (module.to_empty(device=...))"
            )
    if problems:
        raise _incompatible(manifest.model, "does not fit the module", problems)

    loaded_storage = {_storage_key(t) for t in loadable.values()}
    missing = sorted(
        name for name, tensor in state.items() if name not in loadable and _storage_key(tensor) not in loaded_storage
    )
    if strict and (missing or unexpected):
        details = [f"missing from the checkpoint: {name!r}" for name in missing[:_SHOWN]]
        details += [f"not in the module: {name!r}" for name in unexpected[:_SHOWN]]
        raise _incompatible(
            manifest.model,
            f"does not match the module ({len(missing)} missing, {len(unexpected)} unexpected; "
            "pass strict=False to load the tensors that match)",
            details,
        )
    targets = {name: tensor.detach() for name, tensor in loadable.items()}
    return TargetMatch(targets, missing, unexpected)


def _storage_key(tensor: torch.Tensor) -> tuple[object, ...]:
    if tensor.device.type == "meta":
        return ("meta", id(tensor))
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))


def _incompatible(model: str, summary: str, details: list[str]) -> IncompatibleModuleError:
    shown = "; ".join(details[:_SHOWN])
    more = f"; and {len(details) - _SHOWN} more" if len(details) > _SHOWN else ""
    return IncompatibleModuleError(
        f"model {model!r} {summary}: {shown}{more}; the module was not written", partially_written=False
    )
