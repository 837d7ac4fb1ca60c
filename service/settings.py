"""The server's settings: the one place that reads WEIGHTSTREAM_* environment variables."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightstream import wire

ENV_PREFIX = "WEIGHTSTREAM_"


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """Everything `weightstream serve` can be told; each field is also WEIGHTSTREAM_<FIELD>."""

    model_root: Path | None = None
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    # 0 turns the REST endpoint off.
    http_port: int = 8080
    max_streams: int = 16
    # Bytes each stream may read ahead of what it has sent; bounds server memory per stream.
    read_ahead_bytes: int = 256 * 1024 * 1024
    chunk_bytes: int = wire.DEFAULT_CHUNK_BYTES
    # Run:ai streamer reader threads per stream; None keeps the streamer's default.
    streamer_concurrency: int | None = None
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.grpc_port <= 65535:
            problems.append(f"grpc_port {self.grpc_port} is not a port number")
        if not 0 <= self.http_port <= 65535:
            problems.append(f"http_port {self.http_port} is not a port number")
        if self.max_streams < 1:
            problems.append(f"max_streams must be at least 1, not {self.max_streams}")
        if not wire.MIN_CHUNK_BYTES <= self.chunk_bytes <= wire.MAX_CHUNK_BYTES:
            problems.append(
                f"chunk_bytes must be within {wire.MIN_CHUNK_BYTES}..{wire.MAX_CHUNK_BYTES}, not {self.chunk_bytes}"
            )
        if self.read_ahead_bytes < wire.MAX_CHUNK_BYTES:
            problems.append(f"read_ahead_bytes must be at least {wire.MAX_CHUNK_BYTES}, not {self.read_ahead_bytes}")
        if self.streamer_concurrency is not None and self.streamer_concurrency < 1:
            problems.append(f"streamer_concurrency must be at least 1, not {self.streamer_concurrency}")
        if self.model_root is None:
            problems.append("no model root: pass --model-root DIR or set WEIGHTSTREAM_MODEL_ROOT")
        if problems:
            raise ValueError("invalid server settings: " + "; ".join(problems))

    @classmethod
    def load(cls, given: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ServerSettings:
        """Settings from given values (None means not given), then WEIGHTSTREAM_* variables, then defaults."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = given.get(f.name)
            if value is None:
                raw = environ.get(ENV_PREFIX + f.name.upper())
                if raw is None or raw == "":
                    continue
                value = _convert(f.name, str(f.type), raw)
            values[f.name] = value
        if values.get("model_root") is not None:
            values["model_root"] = Path(values["model_root"])
        return cls(**values)


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _convert(name: str, type_name: str, raw: str) -> Any:
    if "int" in type_name:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{env_name(name)}={raw!r} is not an integer") from None
    return raw
