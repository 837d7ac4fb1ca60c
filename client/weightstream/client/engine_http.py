"""JSON over HTTP to an inference engine's control routes (vLLM's weight transfer, SGLang's updates).

Only the standard library (urllib); an engine started with an API key gets it as a bearer token.
A failed route is an EngineHttpError naming the URL, the status and the engine's answer.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

# An update pulls and re-processes layers: allow it time on a large model.
UPDATE_TIMEOUT_S = 900.0


class EngineHttpError(RuntimeError):
    """A route of an engine's HTTP server failed: its path, status and answer."""


class EngineRoutes:
    """The routes of one engine's HTTP server (base URL such as http://127.0.0.1:8000).

    unreachable: what to suggest when nothing answers (which server, started how).
    """

    def __init__(
        self, url: str, *, api_key: str | None = None, timeout: float = UPDATE_TIMEOUT_S, unreachable: str = ""
    ) -> None:
        self.url = url.rstrip("/")
        self._api_key = api_key
        self._timeout = timeout
        self._unreachable = unreachable

    def call(self, method: str, path: str, body: dict[str, Any] | None, *, error: type[Exception] | None = None) -> Any:
        """method path with body as JSON; the answer's JSON (None when empty)."""
        failure = error or EngineHttpError
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}/{path}", data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self._api_key:
            request.add_header("Authorization", f"Bearer {self._api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self._timeout) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:2000]
            raise failure(f"{self.url}/{path}: HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            hint = f" ({self._unreachable})" if self._unreachable else ""
            raise failure(f"{self.url}/{path}: {reason}{hint}") from None
        return json.loads(raw) if raw else None
