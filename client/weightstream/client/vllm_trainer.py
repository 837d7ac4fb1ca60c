"""vLLM's trainer side with the `weightstream` backend: what an RL framework calls after each optimizer step.

The RL frameworks that sync through vLLM's trainer API (TRL, open-instruct, prime-rl, SkyRL)
pick weightstream with their init info alone::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from weightstream.client.vllm_transfer import WeightStreamTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        WeightStreamTrainerInitInfo(target="weightstream:50051", model="m", rank=rank),
        client=HTTPVLLMWeightSyncClient("http://vllm:8000"),
        source=ModuleSource(model))
    for batch in data:
        ...; optimizer.step()
        engine.send_weights()

The engine behind it (`vllm serve --weight-transfer-config '{"backend": "weightstream"}'`) is told
where to pull from by trainer_init (client.init_weight_transfer_engine, on rank 0), so the trainer
is the one place it is configured.

send_weights(), on every trainer rank, in two phases:

1. publish: every rank iterates the source in lockstep (vLLM's contract: iterating may be a
   collective, an FSDP full_tensor()), and publishes what it holds to the weightstream server as
   one part of the same revision (no gather on rank 0). A source whose held_names() is None (every
   rank holds every tensor) is published by rank 0 alone; one that splits the names across ranks
   is published by each rank, part `rank` of `world_size`. Every part's call returns once the
   whole revision is current on the server.
2. engine: rank 0 drives start_weight_update, update_weights({"revision": R}) and
   finish_weight_update(weight_version=R) through the client; each engine rank then pulls what
   changed since the revision it holds (its own slices of it).

Revision names are `{revision_prefix}{n}`, n counting this engine's sends, from one past the n of
the model's current revision when that has the prefix (a restarted trainer goes on counting), so
every rank names the same revision without talking to the others.

Failures (WeightSyncError names the phase): a publish that fails leaves the server's current
revision, and so the engine, as they were; the engine is not asked to update. An engine call that
fails after start_weight_update is followed by finish_weight_update without a weight version, so
that the engine puts back the layers it had taken apart; with init_info deltas the engine pulls
into its host copy before it touches the model, so when the pull fails it still serves its
previous revision (not when vLLM's own load_weights fails after it), and without (or for an update
deltas="auto" sent whole, streamed straight in), the layers that had received weights hold the new
revision's (the next send pulls every tensor changed since the previous revision again, so it
repairs them). In both cases the next send_weights() starts afresh with a new revision name.

With deltas=True the trainer keeps a host copy of what it published (memory of its part's size) and
each publish sends only the chunks that changed, as XOR deltas where smaller; the engine keeps its
own host copy and pulls the deltas too. With deltas="auto" a publish that went whole against its
base (every chunk, no host copy compared) is marked so in update_info ({"revision": R, "whole":
true}) when the next publish sends whole too: the engine streams it straight into the model, as
without deltas (and with their failure semantics), and its host copy takes the update before the
first publish that encodes again.

Concurrency: one send_weights() at a time per engine; every rank must call it the same number of times.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from weightstream.client.errors import AbortedError, WeightStreamError
from weightstream.client.facade import PublishReport, WeightStreamClient
from weightstream.client.vllm_loader import TRANSFER_BACKEND
from weightstream.protocol import names

if TYPE_CHECKING:
    from typing import Self

    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient, WeightSource

logger = logging.getLogger("weightstream.vllm_trainer")

Phase = Literal["publish", "start", "update", "finish"]

# Names tried in one send when the server has the name already (a restarted trainer).
NAME_TRIES = 64
# A revision name ends in the send's number: `step-12`.
_NUMBERED = re.compile(r"(\d{1,18})")


class WeightSyncError(RuntimeError):
    """A send_weights() that failed: the phase that failed, the revision it was sending, and what the
    engine serves now (in the message)."""

    def __init__(self, message: str, *, phase: Phase, revision: str) -> None:
        super().__init__(message)
        self.phase = phase
        self.revision = revision


@dataclass
class WeightStreamTrainerInitInfo(TrainerInitInfo):
    """The trainer side of the weightstream backend: where to publish, and what the engines need to pull.

    target, model: the weightstream server and the model id (the engine's, as its load_format
    weightstream loaded it). engine_target: the server's address as the engines reach it (default:
    target). token, tls, ca_file, shm_dir, transport: as the loader's keys, for both sides; token is
    handed to the engine (init_weight_transfer_engine, over the client's transport), so it should be a
    read token. publish_token: the token the trainer publishes with (default: token); give it apart
    so that no engine ever holds a token that may publish. deltas: the trainer sends only what
    changed (keeping a host copy of its part) and the engine pulls deltas into its own host copy;
    "auto" sends the changed chunks as deltas or whole, whichever was faster in its recent publishes
    (WeightStreamClient.publish). world_size: the trainer ranks that call send_weights (parts of a
    revision when the source splits its names). revision_prefix: revision names are prefix + send number.
    """

    backend: ClassVar[str] = TRANSFER_BACKEND

    target: str = ""
    model: str = ""
    engine_target: str | None = None
    token: str | None = None
    publish_token: str | None = None
    tls: bool = False
    ca_file: str | None = None
    shm_dir: str | None = None
    transport: str = "auto"
    deltas: bool | Literal["auto"] = False
    world_size: int = field(default=1, kw_only=True)
    revision_prefix: str = field(default="step-", kw_only=True)

    def __post_init__(self) -> None:
        for key in ("target", "model"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value:
                raise ValueError(f"WeightStreamTrainerInitInfo.{key} must be a non-empty string, not {value!r}")
        if self.transport not in names.TRANSPORTS:
            raise ValueError(
                f"WeightStreamTrainerInitInfo.transport must be one of {names.TRANSPORTS}, not {self.transport!r}"
            )
        if not isinstance(self.tls, bool):
            raise ValueError(f"WeightStreamTrainerInitInfo.tls must be true or false, not {self.tls!r}")
        if not (isinstance(self.deltas, bool) or self.deltas == "auto"):
            raise ValueError(f'WeightStreamTrainerInitInfo.deltas must be true, false or "auto", not {self.deltas!r}')
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"WeightStreamTrainerInitInfo.world_size must be 1 or more, not {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"WeightStreamTrainerInitInfo.rank must be 0 to world_size - 1 ({self.world_size - 1}), "
                f"not {self.rank!r}"
            )
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", self.revision_prefix):
            raise ValueError(
                "WeightStreamTrainerInitInfo.revision_prefix must be 1 to 100 letters, digits, '.', '_' and '-', "
                f"starting with a letter or digit, not {self.revision_prefix!r}"
            )

    def engine_init_info(self) -> dict[str, Any]:
        """What the engine's init_weight_transfer_engine takes (the worker side's WeightStreamInitInfo)."""
        info: dict[str, Any] = {
            "target": self.engine_target or self.target,
            "model": self.model,
            "token": self.token,
            "tls": self.tls or None,
            "ca_file": self.ca_file,
            "shm_dir": self.shm_dir,
            "transport": self.transport,
            "deltas": bool(self.deltas),
        }
        return {key: value for key, value in info.items() if value is not None}


@dataclass(frozen=True)
class StepReport:
    """What one send_weights() cost: the publish (this rank's part) and the engine's update (rank 0 only;
    0 elsewhere), in seconds and bytes."""

    revision: str
    publish_seconds: float
    publish_bytes: int
    publish_sent_bytes: int
    update_seconds: float
    seconds: float


class WeightStreamTrainerEngine(TrainerWeightTransferEngine[WeightStreamTrainerInitInfo]):
    """Publishes the trainer's weights to a weightstream server and has the vLLM engine pull them."""

    init_info_cls = WeightStreamTrainerInitInfo

    def __init__(
        self,
        init_info: WeightStreamTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        publisher: WeightStreamClient,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.init_info = init_info
        self.publisher = publisher
        self.sends = _first_number(publisher, init_info) - 1
        self.last_step: StepReport | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: WeightStreamTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("the weightstream trainer engine needs a WeightSource (e.g. ModuleSource(model))")
        if not isinstance(init_info, WeightStreamTrainerInitInfo):
            raise ValueError(f"the weightstream trainer engine takes WeightStreamTrainerInitInfo, not {init_info!r}")
        publisher = WeightStreamClient(
            init_info.target,
            token=init_info.publish_token or init_info.token,
            tls=init_info.tls,
            ca_file=init_info.ca_file,
            progress=False,
            transport=init_info.transport,  # type: ignore[arg-type]
            shm_dir=init_info.shm_dir,
        )
        try:
            engine = cls(init_info, client=client, source=source, publisher=publisher)
            if engine.is_sender:
                client.init_weight_transfer_engine(init_info.engine_init_info())
        except BaseException:
            publisher.close()
            raise
        logger.info(
            "weightstream: trainer rank %d of %d publishes %s to %s; the next revision is %s",
            init_info.rank,
            init_info.world_size,
            init_info.model,
            init_info.target,
            engine.next_revision,
        )
        return engine

    @property
    def next_revision(self) -> str:
        return f"{self.init_info.revision_prefix}{self.sends + 1}"

    def send_weights(self) -> None:
        """Publish this rank's part of the next revision, then (rank 0) have the engine pull it. Raises
        WeightSyncError naming the phase that failed; the next call starts afresh."""
        info = self.init_info
        self.sends += 1
        revision = f"{info.revision_prefix}{self.sends}"
        started = time.perf_counter()
        assert self.source is not None
        held = self.source.held_names()  # asked once per send: every use below agrees
        split = held is not None and info.world_size > 1
        tensors = self._held_tensors(held)
        if split and not tensors:
            raise WeightSyncError(
                f"weightstream: rank {info.rank} holds none of {info.model!r}'s tensors (the source's held_names()), "
                f"but the revision is published in {info.world_size} parts, one per rank",
                phase="publish",
                revision=revision,
            )
        try:
            for _ in range(NAME_TRIES):
                if not tensors:
                    break
                try:
                    self.publisher.publish(
                        info.model,
                        tensors,
                        revision=revision,
                        part=info.rank if split else 0,
                        parts=info.world_size if split else 1,
                        deltas=info.deltas,
                    )
                    break
                except AbortedError as exc:
                    # The name is taken (kept, or used before and no longer kept: a restarted trainer
                    # after other revisions): every rank is told the same, and goes on to the next.
                    if "name another" not in str(exc):
                        raise
                    logger.info("weightstream: revision %s of %s is taken; trying the next name", revision, info.model)
                    self.sends += 1
                    revision = f"{info.revision_prefix}{self.sends}"
            else:
                raise WeightSyncError(
                    f"weightstream: publish of {info.model!r} (rank {info.rank}) failed: the last {NAME_TRIES} "
                    f"revision names up to {revision!r} are taken; the server's current revision and the engine "
                    "are as they were",
                    phase="publish",
                    revision=revision,
                )
        except WeightStreamError as exc:
            raise WeightSyncError(
                f"weightstream: publish of {info.model!r} revision {revision!r} (rank {info.rank}) failed: {exc}; "
                "the server's current revision and the engine are as they were",
                phase="publish",
                revision=revision,
            ) from exc
        report = self.publisher.last_publish if tensors else None
        published = time.perf_counter()
        if self.is_sender:
            # Every chunk sent whole against the base (deltas="auto" chose it), and the next publish
            # sends whole too: the engine streams it straight into the model, not through its host
            # copy (rank 0's part tells). Before a publish that encodes, the engine's host copy takes
            # it, so that it holds the base of the deltas that follow.
            whole = report is not None and bool(report.delta_base) and not report.encoded and not report.host_copy
            self._update_engine(revision, whole=whole)
        finished = time.perf_counter()
        self.last_step = StepReport(
            revision=revision,
            publish_seconds=published - started,
            publish_bytes=report.bytes if report is not None else 0,
            publish_sent_bytes=report.sent_bytes if report is not None else 0,
            update_seconds=finished - published if self.is_sender else 0.0,
            seconds=finished - started,
        )
        _log_step(info, self.last_step, report)

    def _held_tensors(self, held: Collection[str] | None) -> list[tuple[str, torch.Tensor]]:
        """Iterate the whole source (every rank, in lockstep) and keep what this rank publishes (held: the
        source's held_names())."""
        assert self.source is not None
        mine: Collection[str] | None = set(held) if held is not None else None
        tensors: list[tuple[str, torch.Tensor]] = []
        for name, tensor in self.source:
            if tensor is None:
                continue
            if mine is None and not self.is_sender:
                continue  # every rank holds everything: rank 0 publishes it
            if mine is not None and name not in mine:
                continue
            tensors.append((name, tensor.detach()))
        return tensors

    def _update_engine(self, revision: str, *, whole: bool) -> None:
        """Have the engine pull revision (whole: straight into the model, not through a host copy)."""
        phase: Phase = "start"
        try:
            self.client.start_weight_update()
            phase = "update"
            self.client.update_weights({"revision": revision, "whole": True} if whole else {"revision": revision})
            phase = "finish"
            self.client.finish_weight_update(weight_version=revision)
        except Exception as exc:
            restored = ""
            if phase == "update":
                # Have the engine put back the layers it took apart, holding no new weight version.
                try:
                    self.client.finish_weight_update(weight_version=None)
                except Exception as again:
                    restored = f"; finishing the update after it failed failed too: {again}"
            held = (
                "the engine still serves its previous revision"
                if phase == "start"
                else "the engine still serves its previous revision unless vLLM's load_weights failed after "
                "the pull; the next send_weights() pulls it whole again"
                if phase == "update" and self.init_info.deltas and not whole and not restored
                else "the engine may hold part of it; the next send_weights() pulls it whole again"
            )
            raise WeightSyncError(
                f"weightstream: revision {revision!r} of {self.init_info.model!r} is published, "
                f"but the engine's {_ROUTES[phase]} failed: {exc}{restored}; {held}",
                phase=phase,
                revision=revision,
            ) from exc

    def shutdown(self) -> None:
        self.publisher.close()


_ROUTES: dict[Phase, str] = {
    "publish": "publish",
    "start": "start_weight_update",
    "update": "update_weights",
    "finish": "finish_weight_update",
}


def _first_number(publisher: WeightStreamClient, info: WeightStreamTrainerInitInfo) -> int:
    """The number of the first send: one past the current revision's, when its name is prefix + number."""
    current = publisher.manifest(info.model).revision
    if current.startswith(info.revision_prefix):
        number = _NUMBERED.fullmatch(current[len(info.revision_prefix) :])
        if number is not None:
            return int(number.group(1)) + 1
    return 1


def _log_step(info: WeightStreamTrainerInitInfo, step: StepReport, report: PublishReport | None) -> None:
    how = ""
    if report is not None:
        how = f" over {report.transport}" + (f", deltas since {report.delta_base}" if report.delta_base else "")
    logger.info(
        "weightstream: sent %s revision %s in %.3f s: publish (rank %d) %d bytes, %d on the wire%s in %.3f s; "
        "engine update %.3f s",
        info.model,
        step.revision,
        step.seconds,
        info.rank,
        step.publish_bytes,
        step.publish_sent_bytes,
        how,
        step.publish_seconds,
        step.update_seconds,
    )


class OfflineLLMClient:
    """vLLM's four-method VLLMWeightSyncClient over an offline `LLM` in this process (vLLM ships clients for
    HTTP servers and Ray actors only; the offline LLM's methods take request dicts)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | Iterable[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)
