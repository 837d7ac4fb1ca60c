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
    # Bytes per storage request of the Run:ai streamer; None keeps the streamer's default.
    streamer_chunk_bytes: int | None = None
    log_level: str = "INFO"
    # S3: only these buckets are served (s3://bucket/prefix model ids); empty turns S3 off.
    s3_buckets: tuple[str, ...] = ()
    # Endpoint of an S3-compatible store (MinIO and friends); None uses AWS_ENDPOINT_URL or AWS.
    s3_endpoint: str | None = None
    s3_region: str | None = None
    # Path-style addressing (http://host/bucket/key), which most S3-compatible stores need.
    s3_path_style: bool = False
    # CA bundle for an S3 endpoint with a private certificate authority.
    s3_ca_bundle: str | None = None
    # Per-request S3 timeout of the streamer; its own default (1 s) is too short for slow stores.
    s3_request_timeout_ms: int = 30_000
    # Bearer tokens clients must send, one per line; None serves every caller (see auth.py).
    token_file: Path | None = None
    # PEM files for gRPC over TLS; with tls_client_ca, clients must show a certificate it signed.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    # Seconds that streams in flight get to finish after SIGTERM before they are cancelled.
    drain_seconds: float = 30.0
    # Bytes of recently served tensor data kept in RAM and shared by concurrent streams; 0 turns the
    # cache (and single-flight reads) off.
    cache_bytes: int = 0
    # Models read into the cache at start-up; /readyz waits for them.
    preload: tuple[str, ...] = ()
    # A directory shared with clients on the same host (a pod's emptyDir): turns the shared-memory
    # transport on. None serves gRPC only.
    shm_dir: Path | None = None

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
        if self.model_root is None and not self.s3_buckets:
            problems.append(
                "nothing to serve: pass --model-root DIR (WEIGHTSTREAM_MODEL_ROOT) or --s3-bucket NAME "
                "(WEIGHTSTREAM_S3_BUCKETS)"
            )
        if self.streamer_chunk_bytes is not None and self.streamer_chunk_bytes < 4096:
            problems.append(f"streamer_chunk_bytes must be at least 4096, not {self.streamer_chunk_bytes}")
        if self.s3_request_timeout_ms < 100:
            problems.append(f"s3_request_timeout_ms must be at least 100, not {self.s3_request_timeout_ms}")
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            problems.append("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.drain_seconds < 0:
            problems.append(f"drain_seconds must be at least 0, not {self.drain_seconds}")
        if self.cache_bytes < 0:
            problems.append(f"cache_bytes must be at least 0, not {self.cache_bytes}")
        if self.preload and not self.cache_bytes:
            problems.append("--preload needs a cache: pass --cache-bytes N (WEIGHTSTREAM_CACHE_BYTES)")
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
        for name in ("token_file", "tls_cert", "tls_key", "tls_client_ca", "shm_dir"):
            if values.get(name) is not None:
                values[name] = Path(values[name])
        for name in ("s3_buckets", "preload"):
            if name in values:
                values[name] = tuple(dict.fromkeys(b.strip() for b in values[name] if b.strip()))
        return cls(**values)


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _convert(name: str, type_name: str, raw: str) -> Any:
    if type_name.startswith("tuple"):
        return tuple(part for part in raw.split(",") if part.strip())
    if type_name == "bool":
        if raw.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if raw.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{env_name(name)}={raw!r} is not a boolean (use 1/0, true/false)")
    if "int" in type_name:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{env_name(name)}={raw!r} is not an integer") from None
    if type_name == "float":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{env_name(name)}={raw!r} is not a number") from None
    return raw
