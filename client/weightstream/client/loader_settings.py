"""The settings of an engine's weightstream loader, from its `model_loader_extra_config`.

vLLM (vllm_loader, vllm_transfer's init_info) and SGLang (sglang_loader) take the same keys, with
the same WEIGHTSTREAM_* fallbacks; they are read here once, into a LoaderSettings, and a bad value
is a ValueError that names the key. This module imports no engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from weightstream.client.facade import WeightStreamClient
from weightstream.client.options import MODEL_ENV, TARGET_ENV, ClientOptions
from weightstream.client.retry import RetryPolicy
from weightstream.protocol import names
from weightstream.protocol.names import TransportChoice

LOAD_FORMAT = "weightstream"
KEYS = frozenset({"target", "model", "token", "tls", "ca_file", "shm_dir", "transport", "retry_deadline"})


@dataclass(frozen=True, kw_only=True)
class LoaderSettings:
    """Where the loader streams from, resolved once from the extra config and the environment."""

    target: str
    model: str
    token: str | None = None
    tls: bool = False
    ca_file: str | None = None
    shm_dir: str | None = None
    transport: TransportChoice = "auto"
    # Seconds an outage (a server not up yet, a broken stream) is retried before the load fails.
    retry_deadline: float = RetryPolicy.total_deadline

    def client(self, *, progress: bool = False) -> WeightStreamClient:
        """A client of the server these settings name."""
        return WeightStreamClient(
            self.target,
            token=self.token,
            tls=self.tls,
            ca_file=self.ca_file,
            progress=progress,
            transport=self.transport,
            shm_dir=self.shm_dir,
            retry=RetryPolicy(total_deadline=self.retry_deadline),
        )

    @classmethod
    def resolve(
        cls, extra: Mapping[str, object], model_path: str, environ: Mapping[str, str] | None = None
    ) -> LoaderSettings:
        """Settings from model_loader_extra_config, then WEIGHTSTREAM_* variables and the engine's model path."""
        options = ClientOptions.from_environ(environ)
        unknown = sorted(set(extra) - KEYS)
        if unknown:
            raise ValueError(
                f"model_loader_extra_config for load_format={LOAD_FORMAT!r} has unknown keys {unknown}; "
                f"known: {sorted(KEYS)}"
            )
        target = text(extra, "target") or options.target
        if not target:
            raise ValueError(
                f"load_format={LOAD_FORMAT!r} needs the server's address: model_loader_extra_config "
                f'{{"target": "HOST:PORT"}} or the environment variable {TARGET_ENV}'
            )
        model = text(extra, "model") or options.model or Path(model_path).name
        if not model:
            raise ValueError(f"no weightstream model id: set model_loader_extra_config['model'] or {MODEL_ENV}")
        token = text(extra, "token") or options.token
        transport = text(extra, "transport") or "auto"
        if transport not in names.TRANSPORTS:
            raise ValueError(
                f"model_loader_extra_config['transport'] must be one of {names.TRANSPORTS}, not {transport!r}"
            )
        shm_dir = text(extra, "shm_dir") or (str(options.shm_dir) if options.shm_dir else None)
        deadline = extra.get("retry_deadline", RetryPolicy.total_deadline)
        if isinstance(deadline, bool) or not isinstance(deadline, int | float) or not deadline > 0:
            raise ValueError(f"model_loader_extra_config['retry_deadline'] must be a positive number, not {deadline!r}")
        return cls(
            target=target,
            model=model,
            token=token,
            tls=flag(extra, "tls"),
            ca_file=text(extra, "ca_file"),
            shm_dir=shm_dir,
            transport=transport,
            retry_deadline=float(deadline),
        )


def text(extra: Mapping[str, object], key: str) -> str | None:
    """extra[key] as a stripped string (None when absent or blank); anything but a string is refused."""
    value = extra.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"model_loader_extra_config[{key!r}] must be a string, not {type(value).__name__}")
    return value.strip() or None


def flag(extra: Mapping[str, object], key: str) -> bool:
    """extra[key] as a boolean (default false): true/false, or their usual spellings as strings."""
    value = extra.get(key, False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "0", "false", "no", ""):
        return value.strip().lower() in ("1", "true", "yes")
    raise ValueError(f"model_loader_extra_config[{key!r}] must be true or false, not {value!r}")
