"""In-place updates of a running SGLang engine loaded with `load_format="weightstream"`.

    from weightstream.client.sglang import sync_weights

    sync_weights(engine, revision)                      # an offline sglang.Engine
    sync_weights("http://127.0.0.1:30000", revision)    # python -m sglang.launch_server

Both go through SGLang's own update path, update_weights_from_disk (the Engine's, or POST
/update_weights_from_disk), which pauses generation, has the loader (sglang_loader) pull the
revision into every rank, flushes the cache, and on a failure restores what it held. The revision
travels as the load format, "weightstream:REVISION" (update_format), since SGLang's update request
carries no other field that reaches the loader; the model path sent is the engine's own, so the
name the engine serves under stays. The revision also becomes SGLang's weight_version (/model_info).
A failed update raises SglangUpdateError with SGLang's message; the engine then serves the weights it
held. This module does not import SGLang (the HTTP form needs only the standard library).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from weightstream.client.engine_http import UPDATE_TIMEOUT_S, EngineHttpError, EngineRoutes
from weightstream.client.engine_updates import LATEST
from weightstream.client.loader_settings import LOAD_FORMAT

__all__ = ["SglangServer", "SglangUpdateError", "revision_of_format", "sync_weights", "update_format"]


class SglangUpdateError(EngineHttpError):
    """SGLang refused or failed an update (its message says why); the engine serves its previous weights."""


def update_format(revision: str) -> str:
    """The load format of an update to revision ("latest": the server's current one)."""
    if not isinstance(revision, str) or not revision.strip() or any(c.isspace() for c in revision):
        raise ValueError(f'revision must be a revision name or "latest", not {revision!r}')
    return f"{LOAD_FORMAT}:{revision}"


def revision_of_format(load_format: str) -> str | None:
    """The revision an update's load format names (LATEST for plain "weightstream"); None if not ours."""
    head, _, revision = load_format.partition(":")
    if head.strip().lower() != LOAD_FORMAT:
        return None
    return revision.strip() or LATEST


class SglangServer:
    """The update route of one SGLang HTTP server (base URL such as http://127.0.0.1:30000)."""

    kind = "sglang"

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = UPDATE_TIMEOUT_S) -> None:
        self._routes = EngineRoutes(
            url, api_key=api_key, timeout=timeout, unreachable="is python -m sglang.launch_server running there?"
        )
        self.url = self._routes.url

    def model_info(self) -> dict[str, Any]:
        answer = self._routes.call("GET", "model_info", None, error=SglangUpdateError)
        return answer if isinstance(answer, dict) else {}

    def weight_version(self) -> str | None:
        version = self.model_info().get("weight_version")
        return str(version) if version is not None else None

    def pull(self, revision: str) -> float:
        """Have the engine pull revision in place (as its weight_version too); the seconds it took."""
        started = time.perf_counter()
        body = {
            "model_path": self.model_info().get("model_path") or "",
            "load_format": update_format(revision),
            "weight_version": None if revision == LATEST else revision,
        }
        answer = self._routes.call("POST", "update_weights_from_disk", body, error=SglangUpdateError)
        if not isinstance(answer, dict) or not answer.get("success"):
            raise SglangUpdateError(f"{self.url}/update_weights_from_disk: {answer}")
        return time.perf_counter() - started


def sync_weights(engine: Any, revision: str = LATEST) -> float:
    """Pull revision into every rank of an SGLang engine (an sglang.Engine, or a server's base URL)
    through SGLang's update path; the seconds it took. Raises SglangUpdateError when SGLang reports
    a failure (the engine then serves what it held)."""
    if isinstance(engine, str):
        return SglangServer(engine).pull(revision)
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

    started = time.perf_counter()
    # Engine.update_weights_from_disk, with the weight version that it does not pass on.
    request = UpdateWeightFromDiskReqInput(
        model_path=engine.tokenizer_manager.model_path,
        load_format=update_format(revision),
        weight_version=None if revision == LATEST else revision,
    )
    loop: asyncio.AbstractEventLoop = engine.loop
    success, message, _ = loop.run_until_complete(engine.tokenizer_manager.update_weights_from_disk(request, None))
    if not success:
        raise SglangUpdateError(f"SGLang did not update to {revision}: {message}")
    return time.perf_counter() - started
