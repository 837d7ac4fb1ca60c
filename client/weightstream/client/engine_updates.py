"""What an engine's model holds from weightstream, and the pull of a newer revision into it.

Shared by vLLM's weight-transfer engine (vllm_transfer) and SGLang's update path (sglang_loader);
this module imports neither engine. LOADED records, per model, the revision it holds and the
slice of each checkpoint tensor this rank's loaders read (as engine_loads planned them at the
first load). plan_update() asks the server what changed since that revision and which tensors to
send (the changed ones plus those the model fuses with them into one parameter, since a fused
parameter is rebuilt from all of its parts); full_shaped() places each received slice in a tensor
of the checkpoint's full shape, where the model's loaders narrow to; HostCopy keeps a rank's slices
on the host and brings them up to date with XOR deltas.

One thread per model; the model must not be used meanwhile.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from weightstream.client.errors import FailedPreconditionError, IncompatibleModuleError, NotFoundError
from weightstream.client.facade import LoadReport, WeightStreamClient
from weightstream.client.manifest import Manifest, TensorInfo
from weightstream.client.sharding import sliced_manifest
from weightstream.protocol.wire import TensorSlice

LATEST = "latest"


@dataclass(frozen=True)
class Loaded:
    """What a model last received from weightstream: the model id, its revision, and the slice of
    each checkpoint tensor that this rank's loaders read (None: all of it), as the loader planned them."""

    model: str
    revision: str
    slices: Mapping[str, TensorSlice | None]


# Each engine model's Loaded (the first load's, then each update's), so that an update asks only for
# what changed since, and only this rank's slices of it.
LOADED: weakref.WeakKeyDictionary[nn.Module, Loaded] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class UpdatePlan:
    """One update: the manifest of the revision pulled, the revision held before (since; "" when
    unknown), the tensors to send, this rank's slice of those it takes in part, and their bytes."""

    manifest: Manifest
    since: str
    names: list[str]
    slices: dict[str, TensorSlice]
    nbytes: int


def parameter_device(model: nn.Module) -> torch.device:
    """Where model's parameters live (engines build them on the load device); tensors are streamed there."""
    for param in model.parameters():
        if param.device.type in ("cpu", "cuda"):
            return param.device
    return torch.device("cpu")


def plan_update(
    client: WeightStreamClient,
    model_id: str,
    loaded: Loaded | None,
    revision: str,
    packed: Mapping[str, list[str]],
    *,
    since: str = "",
    logger: logging.Logger,
) -> UpdatePlan:
    """What to pull to bring a model holding loaded (or since, when given) to revision ("" or LATEST:
    the server's current one); every tensor when the server knows no changes since."""
    wanted = "" if revision == LATEST else revision
    since = since or (loaded.revision if loaded is not None else "")
    names: list[str] | None = None
    resolved = ""
    if since:
        try:
            changes = client.changes(model_id, since=since, revision=wanted)
        except (NotFoundError, FailedPreconditionError) as exc:
            logger.warning("weightstream: no changes known since %s (%s): every tensor is pulled", since, exc)
        else:
            resolved = changes.revision
            names = list(changes.tensors)
    manifest = client.manifest(model_id, revision=resolved or wanted)
    all_names = [t.name for t in manifest.tensors]
    names = all_names if names is None else fused_with(names, all_names, packed)
    planned = loaded.slices if loaded is not None else {}
    slices = {n: s for n in names if (s := planned.get(n)) is not None}
    nbytes = sum(manifest[name].nbytes for name in names if name not in slices)
    nbytes += sum(slice_bytes(manifest[name].shape, manifest[name].nbytes, s) for name, s in slices.items())
    return UpdatePlan(manifest, since, names, slices, nbytes)


def full_shaped(received: Iterable[tuple[str, torch.Tensor]], plan: UpdatePlan) -> Iterator[tuple[str, torch.Tensor]]:
    """received, each slice placed in a tensor of its full shape where the model's loaders read it
    (the rest of that tensor is never read)."""
    for name, tensor in received:
        piece = plan.slices.get(name)
        if piece is None:
            yield name, tensor
            continue
        full = torch.empty(plan.manifest[name].shape, dtype=tensor.dtype, device=tensor.device)
        full.narrow(piece.dim, piece.start, piece.stop - piece.start).copy_(tensor)
        yield name, full


class HostCopy:
    """A rank's checkpoint-format slices of a model on the host, brought to each revision with XOR
    deltas where the server holds the copy's revision (whole where not).

    Costs host memory of the rank's share of the checkpoint. The model must not keep or alias these
    tensors: tensors() hands out copies (or the slices' placements), since the next pull rewrites them.
    """

    def __init__(self, client: WeightStreamClient, model_id: str, slices: Mapping[str, TensorSlice | None]) -> None:
        self._client = client
        self._model_id = model_id
        self._slices = {n: s for n, s in slices.items() if s is not None}
        self._tensors: dict[str, torch.Tensor] | None = None
        self.revision = ""

    def pull(self, revision: str, *, logger: logging.Logger) -> LoadReport | None:
        """Make the copy hold revision: whole the first time, then only what changed (all of it again where the
        server no longer keeps the copy's revision); None if it did already."""
        if self._tensors is not None and self.revision == revision:
            return None
        if self._tensors is None:
            manifest = sliced_manifest(self._client.manifest(self._model_id, revision=revision), self._slices)
            self._tensors = {t.name: torch.empty(t.shape, dtype=t.dtype) for t in manifest.tensors}
            self.revision = ""
        report = None
        if self.revision:
            try:
                report = self._client.update_into(
                    self._tensors,
                    self._model_id,
                    since=self.revision,
                    revision=revision,
                    shard=self._slices,
                )
            except NotFoundError as exc:
                if exc.partially_written:
                    raise
                # No deltas since the copy's revision (the server no longer keeps it; nothing was written).
                logger.warning(
                    "weightstream: host copy of %s: no deltas since %s (%s); pulling %s whole",
                    self._model_id,
                    self.revision,
                    exc,
                    revision,
                )
        if report is None:
            report = self._client.load_into(self._tensors, self._model_id, revision=revision, shard=self._slices)
        self.revision = revision
        logger.info(
            "weightstream: host copy of %s at %s: %d tensors, %d bytes changed, %d chunks as deltas (%d bytes), "
            "%d fell back, in %.3f s",
            self._model_id,
            revision,
            report.tensors,
            report.bytes,
            report.delta_chunks,
            report.delta_bytes,
            report.delta_fallbacks,
            report.seconds,
        )
        return report

    def forget(self) -> None:
        """The copy no longer follows the model (it was updated without it): the next pull fills it whole,
        into the same memory."""
        self.revision = ""

    def tensors(self, names: Iterable[str], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
        """names' tensors from the copy, on device: copies, never the copy's own memory."""
        assert self._tensors is not None, "pull() first"
        tensors = self._tensors
        for name in names:
            # A copy (a slice is copied into its placement anyway): the model must not alias the copy.
            yield name, tensors[name].to(device, copy=name not in self._slices)


def slice_bytes(shape: tuple[int, ...], nbytes: int, piece: TensorSlice) -> int:
    """The bytes of piece of a tensor of shape and nbytes."""
    return nbytes // shape[piece.dim] * (piece.stop - piece.start) if shape and shape[piece.dim] else 0


def packed_modules(model: nn.Module) -> dict[str, list[str]]:
    """The model's fused parameters and their checkpoint parts ({"qkv_proj": ["q_proj", "k_proj", "v_proj"]})."""
    mapping = getattr(model, "packed_modules_mapping", None)
    return {k: list(v) for k, v in mapping.items()} if isinstance(mapping, dict) else {}


def fused_with(changed: list[str], all_names: list[str], packed: Mapping[str, list[str]]) -> list[str]:
    """changed, plus every checkpoint tensor fused with one of them into one parameter, in all_names' order."""
    siblings: dict[str, list[str]] = {}
    for parts in packed.values():
        for part in parts:
            siblings[part] = parts
    wanted = set(changed)
    for name in changed:
        pieces = name.split(".")
        for i, piece in enumerate(pieces):
            for other in siblings.get(piece, ()):
                wanted.add(".".join([*pieces[:i], other, *pieces[i + 1 :]]))
    present = set(all_names)
    return [n for n in all_names if n in wanted and n in present]


def check_layout(
    tensors: Iterable[TensorInfo],
    layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    model_id: str,
    revision: str,
) -> None:
    """Refuse a revision whose tensors are not the ones the engine's model holds (names, dtypes, shapes)."""
    problems: list[str] = []
    seen: set[str] = set()
    for info in tensors:
        seen.add(info.name)
        held = layout.get(info.name)
        if held is None:
            problems.append(f"{info.name} is new")
        elif held != (info.dtype, info.shape):
            problems.append(
                f"{info.name} is {info.dtype} {list(info.shape)}, the engine's is {held[0]} {list(held[1])}"
            )
    problems += [f"{name} is gone" for name in sorted(set(layout) - seen)]
    if problems:
        raise IncompatibleModuleError(
            f"revision {revision} of {model_id} does not fit the engine's model: {len(problems)} tensors differ: "
            + "; ".join(problems[:10])
        )
