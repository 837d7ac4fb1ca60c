"""A vLLM weight-transfer engine, `WeightTransferConfig(backend="weightstream")`: running engines pull
each new revision of their weights from a weightstream server, only what changed.

Registered (lazily: this module is imported when an engine is made) by the `vllm.general_plugins`
entry point, vllm_loader.register, in every vLLM process. The trainer side (vllm_trainer:
WeightStreamTrainerInitInfo, re-exported here) is registered in vLLM's WeightTransferTrainerFactory
by the same entry point and whenever this module is imported, since a trainer process may never
load vLLM's plugins.
An RL loop needs three calls per step once the engine is set up::

    llm = LLM(model="/configs/m", load_format="weightstream", model_loader_extra_config={"target": T},
              weight_transfer_config=WeightTransferConfig(backend="weightstream"))
    llm.init_weight_transfer_engine({"init_info": {"target": T}})      # once
    revision = client.publish("m", trainer.named_parameters())          # 1. the trainer publishes
    sync_weights(llm, revision)                                          # 2. start, update, finish

or the same through vLLM's HTTP routes (/init_weight_transfer_engine, /start_weight_update,
/update_weights with {"update_info": {"revision": R}}, /finish_weight_update).

init_info takes the loader's keys (target, model, token, tls, ca_file, shm_dir, transport; the
same environment fallbacks). update_info is {"revision": R} or {"revision": "latest"} (resolved by
each rank on its own: with TP > 1, name the revision, so that a publish in between cannot split the
ranks), plus "whole": true where R was published whole (the trainer side says so, under init_info
deltas: the engine then streams it straight in, not through its host copy). Each rank asks the
server what changed since the revision it holds (the one load_format="weightstream" loaded, or the
last update's; none known: everything), and streams only those tensors, plus the tensors vLLM
fuses with them into one parameter (q/k/v, gate/up: the model's packed_modules_mapping), because a
fused parameter is rebuilt from all of its parts; and of each only the slice this rank's loaders
read, as the loader planned them at the first load (placed in a tensor of the full shape at the
place those loaders narrow to).

The weights go in through vLLM's layerwise reload (model_loader/reload), as vLLM's own engines do:
start_weight_update restores the checkpoint-format parameters of every layer, update_weights hands
the changed tensors to the model's load_weights, and finish_weight_update processes exactly the
layers that received weights (each layer's post-load step, e.g. the CPU backend's prepacked GEMM
weights, runs again for those) and puts back the kernel tensors of the others untouched. Quantized
models are processed by the same path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightstream.client.engine_updates import (
    LATEST,
    LOADED,
    HostCopy,
    Loaded,
    full_shaped,
    packed_modules,
    plan_update,
)
from weightstream.client.errors import FailedPreconditionError, NotFoundError
from weightstream.client.facade import WeightStreamClient
from weightstream.client.loader_settings import LoaderSettings
from weightstream.client.vllm_loader import register_trainer
from weightstream.client.vllm_trainer import OfflineLLMClient, WeightStreamTrainerInitInfo, WeightSyncError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("vllm.weightstream")

__all__ = [
    "OfflineLLMClient",
    "WeightStreamInitInfo",
    "WeightStreamTrainerInitInfo",
    "WeightStreamUpdateInfo",
    "WeightStreamWeightTransferEngine",
    "WeightSyncError",
    "sync_weights",
]


@dataclass
class WeightStreamInitInfo(WeightTransferInitInfo):
    """Where the engine pulls from: the loader's model_loader_extra_config keys."""

    target: str | None = None
    model: str | None = None
    token: str | None = None
    tls: bool | None = None
    ca_file: str | None = None
    shm_dir: str | None = None
    transport: str | None = None
    # Keep a host copy of this rank's slices (in the checkpoint's format) and update it with XOR
    # deltas, feeding the model what changed from there: a sparse step then moves a few percent of
    # the bytes. Costs host memory of the rank's share of the checkpoint; off by default.
    deltas: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.deltas, bool):
            raise ValueError(f'init_info["deltas"] must be true or false, not {self.deltas!r}')


@dataclass
class WeightStreamUpdateInfo(WeightTransferUpdateInfo):
    """The revision to pull: a name, or "latest" for the server's current one. whole: the revision was
    published whole (not as deltas), so an engine with init_info deltas streams it straight into the
    model, as one without does, not through its host copy (refilled whole at the next update not
    marked whole)."""

    revision: str = LATEST
    whole: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.revision, str) or not self.revision.strip():
            raise ValueError(f'update_info["revision"] must be a revision name or "latest", not {self.revision!r}')
        if not isinstance(self.whole, bool):
            raise ValueError(f'update_info["whole"] must be true or false, not {self.whole!r}')


class WeightStreamWeightTransferEngine(WeightTransferEngine[WeightStreamInitInfo, WeightStreamUpdateInfo]):
    """Pulls the tensors that changed between revisions from a weightstream server into the running model."""

    init_info_cls = WeightStreamInitInfo
    update_info_cls = WeightStreamUpdateInfo
    supports_draft_weight_update = False

    def __init__(
        self, config: WeightTransferConfig, vllm_config: VllmConfig, device: torch.device, model: torch.nn.Module
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._client: WeightStreamClient | None = None
        self._model_id = ""
        self._target = ""
        self._updating = False
        # The revision received by the update in progress, recorded once it is finished.
        self._pending: str | None = None
        self._started = 0.0
        self._tensors = 0
        self._bytes = 0
        self._since = ""
        # With init_info deltas: the rank's checkpoint-format slices on the host.
        self._host_copy: HostCopy | None = None

    def init_transfer_engine(self, init_info: WeightStreamInitInfo) -> None:
        extra = {key: value for key, value in asdict(init_info).items() if value is not None and key != "deltas"}
        settings = LoaderSettings.resolve(extra, self.model_config.model)
        if self._client is not None:
            self._client.close()
        self._client = settings.client()
        self._model_id = settings.model
        self._target = settings.target
        loaded = self._loaded()
        self._host_copy = (
            HostCopy(self._client, settings.model, loaded.slices if loaded is not None else {})
            if init_info.deltas
            else None
        )
        if loaded is not None:
            # Tell the server which revision this engine holds: it keeps that revision's block
            # CRC32Cs from now on, so that the next update finds what changed even in rewritten files.
            self._client.changes(settings.model, since=loaded.revision, revision=loaded.revision)
            if self._host_copy is not None:
                try:
                    self._host_copy.pull(loaded.revision, logger=logger)
                except (NotFoundError, FailedPreconditionError) as exc:
                    logger.warning(
                        "weightstream: revision %s is gone (%s): the first update fills the host copy",
                        loaded.revision,
                        exc,
                    )
        logger.info(
            "weightstream: weight transfer from %s, model %s, holding revision %s",
            settings.target,
            settings.model,
            loaded.revision if loaded is not None else "unknown (the first update pulls every tensor)",
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._check_ready()
        initialize_layerwise_reload(self.model)
        self._updating = True
        self._pending = None
        self._started = time.perf_counter()
        self._tensors = self._bytes = 0

    def receive_weights(self, update_info: WeightStreamUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        client = self._check_ready()
        if not self._updating:
            raise RuntimeError("weightstream: update_weights needs start_weight_update first")
        plan = plan_update(
            client,
            self._model_id,
            self._loaded(),
            update_info.revision,
            packed_modules(self.model),
            since=self._pending or "",
            logger=logger,
        )
        copy = self._host_copy
        if copy is not None and update_info.whole:
            copy.forget()
            copy = None
            logger.info(
                "weightstream: %s was published whole: streamed straight into the model; the host copy is "
                "refilled at the next update not marked whole",
                plan.manifest.revision,
            )
        if copy is not None:
            copy.pull(plan.manifest.revision, logger=logger)
            received = copy.tensors(plan.names, self.device)
        else:
            received = client.iter_tensors(
                self._model_id,
                names=plan.names,
                device=self.device,
                slices=plan.slices,
                revision=plan.manifest.revision,
            )

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            if plan.names:
                yield from full_shaped(received, plan)

        with disable_mtp_completeness_check():
            self.model.load_weights(weights())
        self._pending = plan.manifest.revision
        self._since = plan.since
        self._tensors += len(plan.names)
        self._bytes += plan.nbytes

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if not self._updating:
            raise RuntimeError("weightstream: finish_weight_update without start_weight_update")
        finalize_layerwise_reload(self.model, self.model_config)
        self._updating = False
        if self._pending is None:
            return
        previous = self._loaded()
        LOADED[self.model] = Loaded(self._model_id, self._pending, previous.slices if previous is not None else {})
        seconds = time.perf_counter() - self._started
        logger.info(
            "weightstream: updated %s from %s to %s: %d tensors, %d bytes in %.3f s (%.2f GB/s) from %s",
            self._model_id,
            self._since or "(unknown)",
            self._pending,
            self._tensors,
            self._bytes,
            seconds,
            self._bytes / seconds / 1e9 if seconds > 0 else 0.0,
            self._target,
        )
        self._pending = None

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _loaded(self) -> Loaded | None:
        loaded = LOADED.get(self.model)
        return loaded if loaded is not None and loaded.model == self._model_id else None

    def _check_ready(self) -> WeightStreamClient:
        if self._client is None:
            raise RuntimeError("weightstream: init_weight_transfer_engine comes first")
        return self._client


def sync_weights(llm: Any, revision: str = LATEST) -> None:
    """Pull revision into every worker of an offline vLLM LLM: start, update and finish, with the
    revision as vLLM's weight version."""
    llm.start_weight_update()
    llm.update_weights({"update_info": {"revision": revision}})
    llm.finish_weight_update(weight_version=None if revision == LATEST else revision)


register_trainer()
