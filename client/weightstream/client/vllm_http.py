"""A running `vllm serve` told to pull a revision through its weight-transfer HTTP routes.

vLLM serves the routes with VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/rl/online/api_router.py):
/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update and
/weight_info. With the `weightstream` backend (--weight-transfer-config '{"backend": "weightstream"}')
an update names a revision, and every rank of the engine pulls its own slices of what changed. The
revision is named here, resolved once, so that every rank pulls the same one. Only the standard
library is used (urllib); an engine started with --api-key gets it as a bearer token.
"""

from __future__ import annotations

import time
from typing import Any

from weightstream.client.engine_http import UPDATE_TIMEOUT_S, EngineHttpError, EngineRoutes


class VllmServerError(EngineHttpError):
    """A route of the vLLM server failed: its path, status and answer."""


class VllmServer:
    """The weight-transfer routes of one vLLM server (base URL such as http://127.0.0.1:8000)."""

    kind = "vllm"

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = UPDATE_TIMEOUT_S) -> None:
        self._routes = EngineRoutes(
            url,
            api_key=api_key,
            timeout=timeout,
            unreachable="is vllm serve running there, with VLLM_SERVER_DEV_MODE=1?",
        )
        self.url = self._routes.url

    def init(self, init_info: dict[str, Any]) -> None:
        """init_info: the loader's keys (target, model, token, tls, ...), where the engine pulls from."""
        self._call("POST", "init_weight_transfer_engine", {"init_info": init_info})

    def pull(self, revision: str) -> float:
        """Start, update to revision, finish (with revision as vLLM's weight version); the seconds it took."""
        started = time.perf_counter()
        self._call("POST", "start_weight_update", None)
        self._call("POST", "update_weights", {"update_info": {"revision": revision}})
        self._call("POST", "finish_weight_update", {"weight_version": revision})
        return time.perf_counter() - started

    def weight_version(self) -> str | None:
        answer = self._call("GET", "weight_info", None)
        version = answer.get("weight_version") if isinstance(answer, dict) else None
        return str(version) if version is not None else None

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        return self._routes.call(method, path, body, error=VllmServerError)
