"""The server's settings: the one place that reads WEIGHTSTREAM_* environment variables.

ServerSettings is the single description of every option of `weightstream serve`: each field's type,
default and description give its flag (--model-root), its variable (WEIGHTSTREAM_MODEL_ROOT) and its
--help line. `add_arguments` puts the flags on a parser; `load` builds the settings from parsed flags
and an environment, a flag beating its variable and the variable beating the default.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, get_origin

from pydantic import BeforeValidator, ByteSize, Field, TypeAdapter, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from weightstream.protocol import wire

ENV_PREFIX = "WEIGHTSTREAM_"

# What a value that failed to parse should have been, by pydantic error type.
_EXPECTED = {
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "bool_parsing": "a boolean (1/0, true/false, yes/no, on/off)",
    "byte_size": "a byte size (for example 16GiB, 512MiB or 1073741824)",
}
_BYTE_SIZE = TypeAdapter(ByteSize)
# A DNS name: dot-separated labels of letters, digits and inner hyphens.
_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*")


def _byte_count(value: object) -> object:
    """A size as people write it (16GiB, 16GB, 512MiB, 1073741824) as a plain int; other types pass on."""
    if not isinstance(value, str):
        return value
    try:
        return int(_BYTE_SIZE.validate_python(value))
    except ValidationError:
        raise PydanticCustomError("byte_size", f"Input should be {_EXPECTED['byte_size']}") from None


def _names(value: object) -> object:
    """A comma-separated string (the environment) or a list (a repeated flag) as a tuple, blanks and repeats dropped."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, list | tuple):
        return value
    stripped = (item.strip() if isinstance(item, str) else item for item in value)
    return tuple(dict.fromkeys(item for item in stripped if item != ""))


# An int that also takes units; the field stays a plain int for the code that reads it.
_BYTE_COUNT = BeforeValidator(_byte_count)
ByteCount = Annotated[int, _BYTE_COUNT]
Names = Annotated[tuple[str, ...], BeforeValidator(_names)]


def _bytes_text(n: int) -> str:
    """n in the largest binary unit that divides it (256MiB), as --help shows defaults."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


@dataclass(frozen=True)
class Flag:
    """The command-line flag of a field whose flag is not --<field-name>."""

    name: str


class ServerSettings(BaseSettings):
    """Everything `weightstream serve` can be told; each field is also WEIGHTSTREAM_<FIELD>.

    Built with keyword arguments (tests, the demo), it holds those values and the defaults and reads no
    environment; `load` is the one reader of flags and WEIGHTSTREAM_* variables. A bad value or
    combination is a ValueError that names each problem.
    """

    # hide_input_in_errors: a report names the problem, not every value given.
    model_config = SettingsConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)

    model_root: Path | None = Field(
        default=None, description="folder whose subfolders are models (<root>/<model>/*.safetensors)"
    )
    host: str = Field(default="127.0.0.1", description="address to listen on (0.0.0.0 for all interfaces)")
    grpc_port: int = Field(default=50051, description="gRPC port; 0 picks a free port")
    http_port: int = Field(
        default=8080, description="REST port for /healthz, /readyz, /status and /metrics; 0 turns it off"
    )
    data_port: int = Field(
        default=50052,
        description="TCP port of the tcp transport's data connections (clients on other hosts); 0 turns it off",
    )
    data_advertise: str | None = Field(
        default=None,
        description="HOST or HOST:PORT clients dial for the data port (a pod's IP; a port where a NAT or proxy "
        "maps it); none: --host when it names one address, else the host of the client's own target",
    )
    max_streams: int = Field(default=16, description="concurrent streams before RESOURCE_EXHAUSTED")
    max_streams_per_client: int | None = Field(
        default=None,
        description="stream slots one client (a bearer token, else a peer host) may hold at once; "
        "default every slot but one (at least 1), so that one is always left for another client",
    )
    stall_timeout: float = Field(
        default=60.0,
        description="seconds a stream may wait on a client that takes nothing it is sent before the stream is "
        "ended (its slot, worker and buffers freed)",
    )
    read_ahead_bytes: ByteCount = Field(
        default=256 * 1024 * 1024,
        description="bytes each stream reads ahead of what it sent; bounds server memory per stream",
    )
    chunk_bytes: ByteCount = Field(
        default=wire.DEFAULT_CHUNK_BYTES,
        description=f"default payload bytes per chunk ({_bytes_text(wire.MIN_CHUNK_BYTES)} to "
        f"{_bytes_text(wire.MAX_CHUNK_BYTES)})",
    )
    streamer_concurrency: int | None = Field(
        default=None, description="Run:ai streamer reader threads per stream; none keeps the streamer's default"
    )
    streamer_chunk_bytes: ByteCount | None = Field(
        default=None, description="bytes per storage request of the Run:ai streamer; none keeps the streamer's default"
    )
    log_level: str = Field(default="INFO", description="DEBUG, INFO, WARNING or ERROR")
    s3_buckets: Annotated[Names, Flag("--s3-bucket")] = Field(
        default=(),
        description="serve s3://NAME/... models from this bucket (repeatable; env comma-separated); none: no S3",
    )
    gcs_buckets: Annotated[Names, Flag("--gcs-bucket")] = Field(
        default=(),
        description="serve gs://NAME/... models from this Google Cloud Storage bucket (repeatable; env "
        "comma-separated; needs weightstream[gcs]); credentials: Google's default chain, STORAGE_EMULATOR_HOST "
        "for an emulator",
    )
    azure_containers: Annotated[Names, Flag("--azure-container")] = Field(
        default=(),
        description="serve az://NAME/... models from this Azure Blob container (repeatable; env comma-separated; "
        "needs weightstream[azure]); account and credentials: AZURE_STORAGE_CONNECTION_STRING, or "
        "AZURE_STORAGE_ACCOUNT_NAME with a key, SAS token or DefaultAzureCredential",
    )
    s3_endpoint: str | None = Field(
        default=None,
        description="endpoint URL of an S3-compatible store (MinIO and friends); none: AWS_ENDPOINT_URL or AWS",
    )
    s3_region: str | None = Field(default=None, description="S3 region; none: AWS_REGION or the profile's")
    s3_path_style: bool = Field(
        default=False,
        description="path-style S3 addressing (http://host/bucket/key), which most S3-compatible stores need",
    )
    s3_ca_bundle: str | None = Field(
        default=None, description="CA bundle file for an S3 endpoint with a private authority"
    )
    storage_timeout: float = Field(
        default=120.0,
        description="seconds a stream waits for each read of an object store (S3, GCS, Azure), the store's own "
        "retries included, before it ends UNAVAILABLE",
    )
    s3_request_timeout_ms: int = Field(
        default=30_000,
        description="per-request S3 timeout of the streamer (its own default, 1 s, is too short for slow stores)",
    )
    token_file: Path | None = Field(
        default=None, description="file of bearer tokens clients must send, one per line; none serves every caller"
    )
    tls_cert: Path | None = Field(
        default=None, description="PEM certificate chain: serve gRPC over TLS (needs --tls-key)"
    )
    tls_key: Path | None = Field(default=None, description="PEM private key of --tls-cert")
    tls_client_ca: Path | None = Field(
        default=None, description="PEM CA bundle; clients must show a certificate it signed (mutual TLS)"
    )
    drain_seconds: float = Field(
        default=30.0, description="seconds that streams in flight get to finish after SIGTERM before they are cancelled"
    )
    cache_bytes: ByteCount = Field(
        default=0,
        description="RAM cache of served tensor bytes, shared by concurrent streams (single-flight reads); 0: off",
    )
    keep_revisions: int = Field(
        default=2, description="revisions of each model kept and servable by name (the current and the previous one)"
    )
    allow_publish: bool = Field(
        default=False,
        description="take publishes (PublishTensors) from anyone who reaches the port: for loopback, tests and "
        "trusted networks",
    )
    publish_token_file: Path | None = Field(
        default=None,
        description="file of publisher tokens, one per line: publishes must present one (a role apart from the "
        "read tokens of --token-file)",
    )
    publish_dir: Path | None = Field(
        default=None,
        description="folder each complete published revision is written to, as safetensors under MODEL/REVISION/ "
        "(atomically); none: published revisions live in memory only",
    )
    publish_s3_prefix: str | None = Field(
        default=None,
        description="s3://BUCKET/PREFIX each complete published revision is uploaded to, as safetensors under "
        "MODEL/REVISION/ with its index first (the --s3-endpoint, --s3-region and credentials of the S3 "
        "settings); none: not uploaded",
    )
    publish_max_bytes: ByteCount = Field(
        default=32 * 1024 * 1024 * 1024,
        description="memory that published revisions may hold together (those kept and the one arriving)",
    )
    publish_assembly_timeout: float = Field(
        default=30.0,
        description="seconds a revision published in several parts waits, after its first part is complete, for a "
        "part that has not begun to arrive (parts arriving are bounded by --stall-timeout per message); a part "
        "whose call fails or is cancelled drops the revision at once",
    )
    delta_cache_bytes: ByteCount = Field(
        default=256 * 1024 * 1024,
        description="XOR deltas (against a revision this server holds) kept for every client updating between the "
        "same two revisions, computed once, and as much again for peers' blocks (fan-out); 0: no deltas, changed "
        "chunks go whole",
    )
    max_watches: int = Field(
        default=32, description="WatchModel calls open at once (each holds a worker thread), half per client"
    )
    watch_interval: float = Field(
        default=5.0, description="seconds between checks of a watched model's files for a new storage revision"
    )
    preload: Names = Field(
        default=(), description="read MODEL into the cache at start-up; /readyz waits (repeatable; env comma-separated)"
    )
    upstream: str | None = Field(
        default=None,
        description="another weightstream server to serve the models this one does not hold: HOST:PORT, several "
        "comma-separated, or a name such as dns:///weightstream-headless:50051 that resolves to its replicas",
    )
    upstream_token_file: Path | None = Field(
        default=None, description="file whose first line is the bearer token sent to --upstream"
    )
    upstream_tls: bool = Field(default=False, description="connect to --upstream over TLS")
    upstream_ca_file: Path | None = Field(
        default=None, description="PEM CA bundle that signed --upstream's certificate; none: the system's roots"
    )
    upstream_client_cert: Path | None = Field(
        default=None, description="PEM certificate shown to --upstream when it requires mutual TLS"
    )
    upstream_client_key: Path | None = Field(default=None, description="PEM private key of --upstream-client-cert")
    peers: bool = Field(
        default=False,
        description="fleet fan-out: take published revisions' blocks, and with --disk-cache storage revisions' "
        "files, from the peers --upstream names (each block checked against the upstream's BLAKE3 hashes) and serve "
        "them to peers on the gRPC port",
    )
    peer_stall_seconds: float = Field(
        default=2.0,
        description="seconds without a block from a peer (a killed, cut or stalled peer) before the rest of the "
        "revision is taken from --upstream instead",
    )
    peer_min_rate: ByteCount = Field(
        default=2 * 1024 * 1024,
        description="bytes per second a peer must forward a revision's blocks at, judged from its first block over "
        "at least two --peer-stall-seconds; a slower peer is left and the rest taken from --upstream (a slow peer "
        "would slow its whole chain); 0: no floor",
    )
    fanout: bool = Field(
        default=False,
        description="fleet fan-out, the upstream's side: plan which peer each watcher with a peer port (a sidecar "
        "with --peers) takes a revision (published or storage) from, and serve GetBlockHashes and "
        "StreamRevisionBlocks; off: watchers are never named a peer and take revisions from this server",
    )
    fanout_roots: int = Field(
        default=1,
        description="fleet fan-out (an upstream of sidecars with --peers): how many peers of a model take each "
        "revision from this server; the others from a peer",
    )
    fanout_degree: int = Field(
        default=1,
        description="fleet fan-out: how many peers take a revision from each peer (1: chains, each peer forwarding "
        "every block as it arrives)",
    )
    disk_cache: Path | None = Field(
        default=None,
        description="directory of a disk cache of the model files read from object stores (S3, GCS, Azure) or "
        "--upstream, bit-identical, kept across restarts; none: no disk cache",
    )
    disk_cache_bytes: ByteCount = Field(
        default=64 * 1024 * 1024 * 1024,
        description="bound of --disk-cache; least recently used files are evicted past it",
    )
    shm_dir: Path | None = Field(
        default=None,
        description="directory shared with clients on the same host (a pod's emptyDir): turns the shared-memory "
        "transport on; none: no shared memory (gRPC and the data port only)",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Keyword arguments only: a server built in code must not pick up its caller's WEIGHTSTREAM_*
        # variables (a token file would break the demo), and load() takes the environment as an argument.
        return (init_settings,)

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        problems = []
        if not 0 <= self.grpc_port <= 65535:
            problems.append(f"grpc_port {self.grpc_port} is not a port number")
        if not 0 <= self.http_port <= 65535:
            problems.append(f"http_port {self.http_port} is not a port number")
        if not 0 <= self.data_port <= 65535:
            problems.append(f"data_port {self.data_port} is not a port number")
        if self.data_advertise is not None:
            try:
                split_host_port(self.data_advertise)
            except ValueError as exc:
                problems.append(f"data_advertise: {exc}")
        if self.keep_revisions < 1:
            problems.append(f"keep_revisions must be at least 1, not {self.keep_revisions}")
        if self.max_watches < 1:
            problems.append(f"max_watches must be at least 1, not {self.max_watches}")
        if self.watch_interval <= 0:
            problems.append(f"watch_interval must be above 0, not {self.watch_interval}")
        if self.max_streams < 1:
            problems.append(f"max_streams must be at least 1, not {self.max_streams}")
        if self.max_streams_per_client is not None and not 1 <= self.max_streams_per_client <= self.max_streams:
            problems.append(
                f"max_streams_per_client must be within 1..max_streams ({self.max_streams}), "
                f"not {self.max_streams_per_client}"
            )
        if not self.publish_assembly_timeout > 0:
            problems.append(
                f"publish_assembly_timeout must be more than 0 seconds, not {self.publish_assembly_timeout}"
            )
        if not self.stall_timeout > 0:
            problems.append(f"stall_timeout must be more than 0 seconds, not {self.stall_timeout}")
        if not wire.MIN_CHUNK_BYTES <= self.chunk_bytes <= wire.MAX_CHUNK_BYTES:
            problems.append(
                f"chunk_bytes must be within {wire.MIN_CHUNK_BYTES}..{wire.MAX_CHUNK_BYTES}, not {self.chunk_bytes}"
            )
        if self.read_ahead_bytes < wire.MAX_CHUNK_BYTES:
            problems.append(f"read_ahead_bytes must be at least {wire.MAX_CHUNK_BYTES}, not {self.read_ahead_bytes}")
        if self.streamer_concurrency is not None and self.streamer_concurrency < 1:
            problems.append(f"streamer_concurrency must be at least 1, not {self.streamer_concurrency}")
        if self.model_root is None and not self.object_buckets and self.upstream is None:
            problems.append(
                "nothing to serve: pass --model-root DIR (WEIGHTSTREAM_MODEL_ROOT), --s3-bucket NAME "
                "(WEIGHTSTREAM_S3_BUCKETS), --gcs-bucket NAME, --azure-container NAME or --upstream TARGET "
                "(WEIGHTSTREAM_UPSTREAM)"
            )
        if self.upstream is not None and self.model_root is not None:
            problems.append(
                "--upstream and --model-root both claim plain model ids; pass one (buckets and containers may go "
                "with --upstream)"
            )
        if self.upstream is None and any(
            v is not None for v in (self.upstream_token_file, self.upstream_ca_file, self.upstream_client_cert)
        ):
            problems.append("--upstream-token-file, --upstream-ca-file and --upstream-client-cert need --upstream")
        if (self.upstream_client_cert is None) != (self.upstream_client_key is None):
            problems.append("mutual TLS to the upstream needs both --upstream-client-cert and --upstream-client-key")
        if self.upstream_client_cert is not None and not self.upstream_tls:
            problems.append("--upstream-client-cert needs --upstream-tls")
        if self.peers and self.upstream is None:
            problems.append("--peers takes revisions from the peers --upstream names: pass --upstream")
        if not self.peer_stall_seconds > 0:
            problems.append(f"peer_stall_seconds must be more than 0, not {self.peer_stall_seconds}")
        if not 1 <= self.fanout_roots <= 4096:
            problems.append(f"fanout_roots must be within 1..4096, not {self.fanout_roots}")
        if not 1 <= self.fanout_degree <= 64:
            problems.append(f"fanout_degree must be within 1..64, not {self.fanout_degree}")
        if self.disk_cache_bytes < 1:
            problems.append(f"disk_cache_bytes must be at least 1, not {self.disk_cache_bytes}")
        if self.disk_cache is not None and self.upstream is None and not self.object_buckets:
            problems.append(
                "--disk-cache keeps files read from object stores or --upstream; pass --s3-bucket, --gcs-bucket, "
                "--azure-container or --upstream"
            )
        if self.streamer_chunk_bytes is not None and self.streamer_chunk_bytes < 4096:
            problems.append(f"streamer_chunk_bytes must be at least 4096, not {self.streamer_chunk_bytes}")
        prefix = self.publish_s3_prefix
        if prefix is not None and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?", prefix):
            problems.append(f"--publish-s3-prefix must be s3://BUCKET/PREFIX, not {prefix[:200]!r}")
        if not self.storage_timeout > 0:
            problems.append(f"storage_timeout must be more than 0 seconds, not {self.storage_timeout}")
        if self.s3_request_timeout_ms < 100:
            problems.append(f"s3_request_timeout_ms must be at least 100, not {self.s3_request_timeout_ms}")
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca is not None and self.tls_cert is None:
            problems.append("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.drain_seconds < 0:
            problems.append(f"drain_seconds must be at least 0, not {self.drain_seconds}")
        if self.delta_cache_bytes < 0:
            problems.append(f"delta_cache_bytes must be at least 0, not {self.delta_cache_bytes}")
        if self.cache_bytes < 0:
            problems.append(f"cache_bytes must be at least 0, not {self.cache_bytes}")
        if self.preload and not self.cache_bytes:
            problems.append("--preload needs a cache: pass --cache-bytes SIZE (WEIGHTSTREAM_CACHE_BYTES)")
        if problems:
            raise PydanticCustomError(
                "invalid_settings", "invalid server settings: {problems}", {"problems": "; ".join(problems)}
            )
        return self

    @property
    def object_buckets(self) -> tuple[str, ...]:
        """The model-id prefixes of every bucket and container served (s3://, gs://, az://)."""
        return (
            *(f"s3://{b}" for b in self.s3_buckets),
            *(f"gs://{b}" for b in self.gcs_buckets),
            *(f"az://{c}" for c in self.azure_containers),
        )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One option per field on parser; each parses to its field's name, None when not given."""
        for name, field in cls.model_fields.items():
            text = f"{field.description} (default: {_default_text(field)}) [env {env_name(name)}]"
            # argparse expands %-formats in help.
            text = text.replace("%", "%%")
            if field.annotation is bool:
                parser.add_argument(flag(name), dest=name, action="store_true", default=None, help=text)
            elif get_origin(field.annotation) is tuple:
                parser.add_argument(flag(name), dest=name, action="append", default=None, help=text)
            else:
                parser.add_argument(flag(name), dest=name, default=None, help=text)

    @classmethod
    def load(cls, given: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ServerSettings:
        """Settings from given values (parsed flags; None means not given), then WEIGHTSTREAM_* variables
        (empty means not set), then defaults. A ValueError names each bad value by its flag or variable."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}
        for name in cls.model_fields:
            if given.get(name) is not None:
                values[name], origins[name] = given[name], flag(name)
            elif environ.get(env_name(name)):
                values[name], origins[name] = environ[env_name(name)], env_name(name)
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ValueError(_describe(exc, origins)) from None


def split_host_port(text: str) -> tuple[str, int | None]:
    """HOST, HOST:PORT or [IPv6]:PORT as (host, port or None); ValueError says what is wrong."""
    host, port = text, None
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{text!r} is not HOST or HOST:PORT")
            port = rest[1:]
    elif text.count(":") == 1:
        host, port = text.split(":")
    if not _is_host(host):
        raise ValueError(f"{host!r} is not a host name or address")
    if port is None:
        return host, None
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{port!r} in {text!r} is not a port number")
    return host, int(port)


def _is_host(text: str) -> bool:
    """Whether text is a bare host: a DNS name, an IPv4 or an IPv6 address (no port, no scheme)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return _HOST_NAME.fullmatch(text) is not None


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag(field_name: str) -> str:
    """The command-line flag of a ServerSettings field: --<field-name>, unless the field names another."""
    field = ServerSettings.model_fields[field_name]
    named = [m.name for m in field.metadata if isinstance(m, Flag)]
    return named[0] if named else "--" + field_name.replace("_", "-")


def _default_text(field: FieldInfo) -> str:
    """A field's default as its --help line says it."""
    default = field.default
    if default is None or default == ():
        return "none"
    if isinstance(default, bool):
        return "on" if default else "off"
    if _BYTE_COUNT in field.metadata and isinstance(default, int):
        return _bytes_text(default)
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


def _describe(exc: ValidationError, origins: Mapping[str, str]) -> str:
    """Each problem in one line, a value named by where it came from (origins) or else by its field."""
    problems = []
    for error in exc.errors(include_url=False):
        if not error["loc"]:
            # The checks across fields, already one message.
            problems.append(error["msg"])
            continue
        name = str(error["loc"][0])
        where = origins.get(name, name)
        if error["type"] == "extra_forbidden":
            problems.append(f"{where} is not a setting")
        elif error["type"] in _EXPECTED:
            problems.append(f"{where}: {error['input']!r} is not {_EXPECTED[error['type']]}")
        else:
            problems.append(f"{where}: {error['msg']}")
    return "; ".join(problems)
