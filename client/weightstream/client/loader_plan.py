"""Which bytes of each checkpoint tensor a model's own weight loaders read, and where they write them.

An engine's `load_weights(weights)` (vLLM's models have one) narrows each checkpoint tensor to what
this rank holds and copies it into a view of a parameter: fused projections (qkv, gate_up) take
row blocks, row-parallel weights column blocks, a padded vocabulary the first rows. Rather than
keep a table of those rules per architecture, plan_loads() runs the model's own loader over a
placeholder of each checkpoint tensor on the meta device (no memory, the tensor's shape and
dtype), under a dispatch mode that records every copy from a placeholder into real memory and
skips it: one call over all the tensors, as the engine's own load makes, and one call per tensor
where that call leaves a doubt. A recorded copy whose source is the placeholder itself, or one
slice of it along one dimension,
and whose destination is a view of one of the model's parameters or buffers, becomes a
WriteTarget: the server sends exactly that slice, and its bytes land in that view (converted on
the copy when the dtypes differ, as the loader's own copy would).

Everything else the loader does runs as it would (filling a vocabulary's padding with zeros, for
example). A tensor whose loader does more than view-and-copy (a transpose before narrowing, a
dtype change before the copy, arithmetic, several slices of one tensor, a read of its values)
cannot be planned; plan_loads() says why, and the caller streams it whole and hands it to the
loader, as before. A tensor the loader takes nothing from (a tied lm_head, rotary caches) needs
no bytes at all.

Memory and threading: the placeholders take none; the WriteTargets hold views of the model's own
parameters. One thread; the model must not be used meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weightstream.client.manifest import Manifest, TensorInfo
from weightstream.protocol.wire import TensorSlice

logger = logging.getLogger(__name__)

_COPY = torch.ops.aten.copy_.default

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[str] | None]


@dataclass(frozen=True)
class WriteTarget:
    """Where one checkpoint tensor's bytes go: the part of it sent (slice None: all of it), and the
    views of the model's tensors that the part is copied into (each with the part's element count)."""

    slice: TensorSlice | None
    views: tuple[torch.Tensor, ...]


@dataclass
class LoadPlan:
    """What plan_loads() found, by checkpoint tensor name.

    targets: tensors whose bytes can be written straight into the model. fallback: tensors to
    stream whole and hand to the loader, with why. unused: tensors the loader takes nothing from.
    loaded: the names the loader reported as loaded for the targets (for the check that every
    parameter was written); reports_loaded is False once a call returned None instead of names.
    """

    targets: dict[str, WriteTarget] = field(default_factory=dict)
    fallback: dict[str, str] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    loaded: set[str] = field(default_factory=set)
    reports_loaded: bool = True


class _Unplannable(Exception):
    """The loader did something with a checkpoint tensor other than copying views of it."""


class _CopyRecorder(TorchDispatchMode):
    """Records copies from placeholders (meta tensors) into real memory (and skips them); runs every other op."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _COPY and isinstance(args[1], torch.Tensor) and args[1].device.type == "meta":
            dst, src = args[0], args[1]
            if dst.device.type == "meta":
                raise _Unplannable("it copies into a tensor of no memory")
            self.copies.append((dst, src))
            return dst
        return func(*args, **(kwargs or {}))


def plan_loads(load_weights: LoadWeights, module: torch.nn.Module, manifest: Manifest) -> LoadPlan:
    """Dry-run load_weights over placeholders of manifest's tensors; see the module doc.

    First in one call over every tensor, as the engine's own load would be: each copy is traced to
    its tensor by the placeholder whose memory it views. Tensors that call gave no copy (unused, or
    written some other way) are then tried one call each, and so is every tensor when that one call
    cannot be read (the loader raised, copied a computed tensor, or replaced a parameter). The
    module's parameters are checked to be the same tensors after each call; a loader that replaced
    one (param.data = ...) is undone and its tensor falls back.
    """
    run = _DryRun(load_weights, module)
    planned = _plan_in_one_call(run, manifest)
    plan, alone = planned if planned is not None else (LoadPlan(), list(manifest.tensors))
    for info in alone:
        _plan_alone(run, info, plan)
    return plan


class _DryRun:
    """Calls of load_weights over placeholders, the copies each made, and undoing what they replaced."""

    def __init__(self, load_weights: LoadWeights, module: torch.nn.Module) -> None:
        self.load_weights = load_weights
        self.module = module
        # Where a copy may write: the storages of module's parameters and buffers, by data pointer.
        self.owners: dict[int, str] = {}
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            self.owners.setdefault(tensor.untyped_storage().data_ptr(), name)
        self._before = {name: param.data for name, param in module.named_parameters()}

    def call(
        self, items: list[tuple[str, torch.Tensor]]
    ) -> tuple[Iterable[str] | None, list[tuple[torch.Tensor, torch.Tensor]]]:
        """load_weights over items: the names it returned and the (destination, source) copies it made."""
        recorder = _CopyRecorder()
        with torch.no_grad(), recorder:
            names = self.load_weights(iter(items))
        return names, recorder.copies

    def restore(self) -> set[str]:
        """Put back any parameter whose data a call replaced; the names of those put back."""
        replaced: set[str] = set()
        for name, param in self.module.named_parameters():
            original = self._before.get(name)
            if original is not None and param.data.data_ptr() != original.data_ptr():
                param.data = original
                replaced.add(name)
        return replaced


def _plan_in_one_call(run: _DryRun, manifest: Manifest) -> tuple[LoadPlan, list[TensorInfo]] | None:
    """The plan of one dry run over all tensors, and the tensors it gave no copy; None if it cannot tell."""
    placeholders = {info.name: torch.empty(info.shape, dtype=info.dtype, device="meta") for info in manifest.tensors}
    by_storage = {t.untyped_storage()._cdata: name for name, t in placeholders.items()}
    try:
        names, recorded = run.call(list(placeholders.items()))
    except Exception:
        run.restore()
        return None
    if run.restore():
        return None
    copies: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for dst, src in recorded:
        name = by_storage.get(src.untyped_storage()._cdata)
        if name is None:
            return None  # a computed tensor: whose, only one call per tensor can tell
        copies.setdefault(name, []).append((dst, src))
    plan = LoadPlan(loaded=set(names or ()), reports_loaded=names is not None)
    alone: list[TensorInfo] = []
    for info in manifest.tensors:
        if info.name not in copies:
            alone.append(info)
            continue
        try:
            target = _target(info, placeholders[info.name], copies[info.name], run.owners)
        except _Unplannable as exc:
            plan.fallback[info.name] = str(exc)
            continue
        if target is not None:
            plan.targets[info.name] = target
    return plan, alone


def _plan_alone(run: _DryRun, info: TensorInfo, plan: LoadPlan) -> None:
    """Dry-run load_weights over info's placeholder alone; put the tensor into plan where it belongs."""
    placeholder = torch.empty(info.shape, dtype=info.dtype, device="meta")
    try:
        names, recorded = run.call([(info.name, placeholder)])
        plan.reports_loaded = plan.reports_loaded and names is not None
        loaded = set(names) if names is not None else set()
        target = _target(info, placeholder, recorded, run.owners)
    except _Unplannable as exc:
        plan.fallback[info.name] = str(exc)
        run.restore()
        return
    except Exception as exc:  # the loader itself failed on a placeholder: it needs the values
        plan.fallback[info.name] = f"its loader raised {type(exc).__name__}: {str(exc)[:200]}"
        run.restore()
        return
    replaced = run.restore()
    if replaced:
        plan.fallback[info.name] = f"its loader replaced {sorted(replaced)[:3]} instead of copying into them"
    elif target is None:
        if loaded:
            plan.fallback[info.name] = f"its loader wrote {sorted(loaded)[:3]} without a copy from it"
        else:
            plan.unused.append(info.name)
    else:
        plan.targets[info.name] = target
        plan.loaded |= loaded


def _target(
    info: TensorInfo,
    placeholder: torch.Tensor,
    copies: list[tuple[torch.Tensor, torch.Tensor]],
    owners: dict[int, str],
) -> WriteTarget | None:
    """The one slice that copies read from placeholder, with their destinations; None if none."""
    if not copies:
        return None
    slices: set[TensorSlice | None] = set()
    views: list[torch.Tensor] = []
    for dst, src in copies:
        slices.add(_slice_of(info, placeholder, src))
        if dst.untyped_storage().data_ptr() not in owners:
            raise _Unplannable("it copies into a tensor that is not one of the model's parameters or buffers")
        if dst.numel() != src.numel() or (dst.shape != src.shape and dst.squeeze().shape != src.squeeze().shape):
            raise _Unplannable(f"it copies {tuple(src.shape)} into {tuple(dst.shape)}, a broadcast")
        views.append(dst)
    if len(slices) > 1:
        raise _Unplannable(f"its loader reads {len(slices)} different parts of it")
    return WriteTarget(slices.pop(), tuple(views))


def _slice_of(info: TensorInfo, placeholder: torch.Tensor, src: torch.Tensor) -> TensorSlice | None:
    """The slice of placeholder that src views (None: all of it); _Unplannable if not one slice."""
    if src.untyped_storage()._cdata != placeholder.untyped_storage()._cdata:
        raise _Unplannable("its loader copies a computed tensor (a dtype change, arithmetic), not a view of it")
    if src.dtype != placeholder.dtype:
        raise _Unplannable(f"its loader reinterprets it as {src.dtype}")
    offset = int(src.storage_offset())
    if src.is_contiguous() and src.numel() == placeholder.numel() and offset == 0:
        return None  # all of it, maybe reshaped
    if src.dim() != placeholder.dim() or src.stride() != placeholder.stride():
        raise _Unplannable(f"its loader reads it as {tuple(src.shape)} with strides {src.stride()}, not one slice")
    narrowed = [d for d in range(src.dim()) if src.shape[d] != placeholder.shape[d]]
    if len(narrowed) != 1:
        raise _Unplannable(f"its loader reads {tuple(src.shape)} of {tuple(placeholder.shape)}, not one slice")
    dim = narrowed[0]
    stride = placeholder.stride(dim)
    start, rest = divmod(offset, stride)
    if rest or start + src.shape[dim] > placeholder.shape[dim]:
        raise _Unplannable(f"its loader reads at element {offset}, not on a slice boundary")
    return TensorSlice(dim=dim, start=start, stop=start + src.shape[dim])
