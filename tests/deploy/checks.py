"""The deployment files' checker: what the manifests, the compose file and the Dockerfile give each container.

The kustomize overlays are rendered with `kubectl kustomize`, the compose file is read with its
variables interpolated, the Dockerfile's final stage is parsed; every container becomes a
Container. problems_of() parses a container's `weightstream` command line and WEIGHTSTREAM_*
variables with the server's own parser and settings, and checks its probes, ports, drain time and
mounts against what those settings say, its disk cache against its volume, and that a server with an
upstream and no bucket carries no S3 credentials (in compose, that its upstream is another service's
gRPC port); security_problems() checks its security context and resources. all_problems() adds what
the other objects of an overlay must agree on: the Services and NetworkPolicies in front of a server
carry its gRPC and data ports, a server behind a Service or with several replicas announces its own
pod IP for the data port, and an upstream names the headless Service and gRPC port of a server of
the cluster (the overlays applied together) whose token and TLS settings it meets, through the
NetworkPolicies on both sides. tests/deploy/test_deploy.py runs the checks on the real files and on broken
copies of them.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import functools
import io
import ipaddress
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from importlib import resources
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from weightstream.cli import build_parser
from weightstream.client.replicas import channel_target
from weightstream_server.ops.health import LIVENESS_SERVICE_NAME, SERVICE_NAME
from weightstream_server.settings import ENV_PREFIX, ServerSettings, env_name, split_host_port

ROOT = Path(__file__).resolve().parents[2]

DOCKERFILE = ROOT / "Dockerfile"

COMPOSE_FILE = ROOT / "deploy" / "docker-compose.yml"

ENV_EXAMPLE = ROOT / "deploy" / ".env.example"

OVERLAYS = sorted(p.parent for p in (ROOT / "deploy" / "k8s" / "overlays").glob("*/kustomization.yaml"))

# 1.29: the first release with native sidecars (restartPolicy: Always on init containers) on by default.
KUBERNETES_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())

# The image every manifest's weightstream container uses, before kustomize's `images:` renames it.
IMAGE_NAMES = ("weightstream", "ghcr.io/example/weightstream", "weightstream:dev", "localhost/weightstream")

HEALTH_PATHS = ("/healthz", "/readyz")

GRPC_HEALTH_SERVICES = ("", SERVICE_NAME, LIVENESS_SERVICE_NAME)

# The client reads this one when no shm_dir is passed (the same-host transport).
CLIENT_SHM_ENV = "WEIGHTSTREAM_SHM_DIR"

# The host a tcp stream tells its client to dial for the data port.
DATA_ADVERTISE_ENV = ENV_PREFIX + "DATA_ADVERTISE"

# The downward API's fields as a pod would see them: values of the right form, so that the settings
# parse what a real pod gets (an address for status.podIP, not an empty string).
FIELD_REF_VALUES = {
    "status.podIP": "10.0.0.7",
    "status.hostIP": "10.0.1.3",
    "metadata.name": "weightstream-0",
    "metadata.namespace": "weightstream",
    "spec.nodeName": "node-0",
}

SERVER_FIELDS = set(ServerSettings.model_fields)

# Where the AWS SDKs (boto3's and the Run:ai streamer's) find credentials in a container's environment.
AWS_CREDENTIAL_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
)

# Audiences of the projected ServiceAccount tokens AWS exchanges for credentials (IRSA, EKS Pod Identity).
AWS_TOKEN_AUDIENCES = ("sts.amazonaws.com", "pods.eks.amazonaws.com")

# On EKS, a ServiceAccount so annotated gets S3 credentials injected into every container of its pods.
IRSA_ANNOTATION = "eks.amazonaws.com/role-arn"

# Kubernetes quantity suffixes (sizeLimit, ephemeral-storage) as multipliers.
_QUANTITY_SUFFIXES = {
    "": 1,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
    "Ei": 1 << 60,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")


def tool(name: str) -> str:
    """A command-line tool from the project's venv (make test installs them), else from PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: `make test` installs it with the dev extra (pip install -e '.[dev]')")
    return found


@functools.cache  # the client's sources do not change during a run, and every check of a file asks
def client_env_names() -> frozenset[str]:
    """WEIGHTSTREAM_* names the client reads: the *_ENV constants of weightstream.client (read, not imported)."""
    names = {CLIENT_SHM_ENV}
    for path in (ROOT / "client" / "weightstream" / "client").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                value = node.value.value
                if isinstance(value, str) and value.startswith(ENV_PREFIX):
                    if any(isinstance(t, ast.Name) and t.id.endswith("_ENV") for t in node.targets):
                        names.add(value)
    return frozenset(names)


# --- what the files say about each container ----------------------------------------------------


@dataclass
class Container:
    """One container of a deployment file, as far as these checks need it."""

    where: str
    image: str
    # The whole `weightstream ...` command line after "weightstream", or None for another program.
    argv: list[str] | None
    env: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    mounts: dict[str, str] = field(default_factory=dict)  # mount path -> volume name (compose: its source)
    read_only: set[str] = field(default_factory=set)  # the mount paths mounted read-only
    spec: dict[str, Any] = field(default_factory=dict)  # the raw Kubernetes container (compose: service)
    field_refs: dict[str, str] = field(default_factory=dict)  # env name -> downward API fieldPath
    workload: dict[str, Any] = field(default_factory=dict)  # the raw Deployment (or other) holding the pod
    host: str = ""  # the name other containers reach it by (a compose service's), if it has one

    @property
    def is_server(self) -> bool:
        return self.argv is not None and self.argv[:1] == ["serve"]


def weightstream_argv(command: list[str] | None, args: list[str] | None, image: str) -> list[str] | None:
    """The arguments after `weightstream` this container runs, or None if it runs something else."""
    if command:
        program = Path(command[0]).name
        if program == "weightstream":
            return [*command[1:], *(args or [])]
        if program.startswith("python") and command[1:3] == ["-m", "weightstream"]:
            return [*command[3:], *(args or [])]
        return None
    if is_weightstream_image(image):
        entrypoint = dockerfile().entrypoint
        assert entrypoint[0] == "weightstream", f"Dockerfile ENTRYPOINT {entrypoint} does not run weightstream"
        return [*entrypoint[1:], *(args or [])]
    return None


def is_weightstream_image(image: str) -> bool:
    return image.split("@")[0].rsplit(":", 1)[0] in {n.rsplit(":", 1)[0] for n in IMAGE_NAMES}


@functools.cache  # building it costs more than a parse; parse_args leaves it as it was
def cli_parser() -> argparse.ArgumentParser:
    return build_parser()


def parse_cli(argv: list[str], where: str) -> argparse.Namespace:
    """argv parsed by `weightstream`'s own parser; ValueError naming where and why when it refuses."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return cli_parser().parse_args(argv)
    except SystemExit:
        last = errors.getvalue().strip().splitlines()[-1:] or ["refused"]
        raise ValueError(f"{where}: `weightstream {shlex.join(argv)}` is not accepted: {last[0]}") from None


def server_settings(container: Container) -> ServerSettings:
    """The settings `weightstream serve` would run with in this container; ValueError when it would refuse."""
    assert container.argv is not None
    namespace = parse_cli(container.argv, container.where)
    unknown = [
        name
        for name in container.env
        if name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX) :].lower() not in SERVER_FIELDS
    ]
    if unknown:
        raise ValueError(f"{container.where}: {', '.join(unknown)} {suggest(unknown[0], server_env_names())}")
    try:
        return ServerSettings.load(vars(namespace), container.env)
    except ValueError as exc:
        raise ValueError(f"{container.where}: {exc}") from None


def server_env_names() -> set[str]:
    return {ENV_PREFIX + name.upper() for name in SERVER_FIELDS}


def suggest(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"is not a setting of weightstream serve{hint}"


def problems_of(containers: list[Container], pods: Mapping[str, dict[str, Any]] | None = None) -> list[str]:
    """Everything wrong with these containers, one sentence each.

    pods maps a container's where to its pod (Kubernetes); without it the containers are the services
    of one compose file, which reach each other by their names.
    """
    problems: list[str] = []
    client_names = client_env_names()
    for c in containers:
        if c.argv is not None and not c.is_server:
            try:
                parse_cli(c.argv, c.where)
            except ValueError as exc:
                problems.append(str(exc))
        if not c.is_server:
            stray = [n for n in c.env if n.startswith(ENV_PREFIX) and n not in client_names]
            problems += [
                f"{c.where}: {n} is not read by the weightstream client ({sorted(client_names)})" for n in stray
            ]
            continue
        try:
            settings = server_settings(c)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        problems += probe_problems(c, settings)
        pod = pods[c.where] if pods is not None else None
        if pod is not None:
            problems += pod_problems(c, settings, pod)
        # The containers that could write to the same volumes: a pod's others, or every other service.
        siblings = [x for x in containers if x is not c and (pods is None or pods[x.where] is pod)]
        problems += disk_cache_problems(c, settings, siblings, pod)
        problems += upstream_credential_problems(c, settings, pod)
        if pods is None:
            problems += compose_upstream_problems(c, settings, containers)
    return problems


def probe_problems(c: Container, settings: ServerSettings) -> list[str]:
    problems = []
    if c.probes and settings.host not in ("0.0.0.0", "::"):
        # Kubelet and Docker probe from outside the container's loopback.
        problems.append(
            f"{c.where}: probes cannot reach a server on host {settings.host}; set WEIGHTSTREAM_HOST=0.0.0.0"
        )
    for kind, probe in c.probes.items():
        if "httpGet" in probe:
            port, path = resolve_port(c, probe["httpGet"]["port"]), probe["httpGet"].get("path", "/")
            if port != settings.http_port:
                problems.append(
                    f"{c.where}: {kind} probes HTTP port {port}, the server's REST port is {settings.http_port}"
                )
            if path not in HEALTH_PATHS:
                problems.append(f"{c.where}: {kind} probes {path}, which is none of {HEALTH_PATHS}")
        elif "grpc" in probe:
            port, service = probe["grpc"]["port"], probe["grpc"].get("service", "")
            if port != settings.grpc_port:
                problems.append(f"{c.where}: {kind} probes gRPC port {port}, the server's is {settings.grpc_port}")
            if service not in GRPC_HEALTH_SERVICES:
                problems.append(
                    f"{c.where}: {kind} asks gRPC health about {service!r}, not one of {GRPC_HEALTH_SERVICES}"
                )
        else:
            problems.append(f"{c.where}: {kind} is neither an HTTP nor a gRPC health probe: {probe}")
    liveness = c.probes.get("livenessProbe")
    # /readyz and gRPC health of "" or the service report readiness (the stores answering): as
    # liveness they would restart healthy servers during a store outage. /healthz and gRPC health
    # of "liveness" report only that the process answers.
    live = liveness is not None and (
        liveness.get("httpGet", {}).get("path") == "/healthz"
        or liveness.get("grpc", {}).get("service") == LIVENESS_SERVICE_NAME
    )
    if liveness is not None and not live:
        problems.append(
            f"{c.where}: livenessProbe must be GET /healthz or gRPC health of {LIVENESS_SERVICE_NAME!r}, not {liveness}"
        )
    if c.ports:
        for name, port in server_ports(settings):
            if port not in c.ports.values():
                problems.append(f"{c.where}: the {name} port {port} is not among the container's ports {c.ports}")
    if settings.data_port and settings.data_port in (settings.grpc_port, settings.http_port):
        problems.append(f"{c.where}: the data port {settings.data_port} is also the gRPC or the REST port")
    return problems


def server_ports(settings: ServerSettings) -> list[tuple[str, int]]:
    """The ports the server listens on, by what they are: gRPC, data (unless off) and REST (unless off)."""
    ports = [("gRPC", settings.grpc_port), ("data", settings.data_port), ("REST", settings.http_port)]
    return [(name, port) for name, port in ports if port or name == "gRPC"]


def resolve_port(c: Container, port: int | str) -> int | None:
    """A port given by number or by the name of one of c's ports (as probes, Services and NetworkPolicies give it)."""
    if isinstance(port, int):
        return port
    return c.ports.get(port)


def pod_problems(c: Container, settings: ServerSettings, pod: dict[str, Any]) -> list[str]:
    problems = []
    grace = pod.get("terminationGracePeriodSeconds", 30)
    pre_stop = c.spec.get("lifecycle", {}).get("preStop", {})
    sleep = 0.0
    if "exec" in pre_stop and pre_stop["exec"]["command"][:1] == ["sleep"]:
        sleep = float(pre_stop["exec"]["command"][1])
    elif "sleep" in pre_stop:
        sleep = float(pre_stop["sleep"]["seconds"])
    if grace <= settings.drain_seconds + sleep:
        problems.append(
            f"{c.where}: terminationGracePeriodSeconds {grace} does not exceed the preStop sleep ({sleep:g} s) plus "
            f"the server's drain ({settings.drain_seconds:g} s): streams in flight would be killed"
        )
    readiness = c.probes.get("readinessProbe", {})
    follows_stores = readiness.get("httpGet", {}).get("path") == "/readyz" or (
        "grpc" in readiness and readiness["grpc"].get("service", "") in ("", SERVICE_NAME)
    )
    if c.spec.get("restartPolicy") == "Always" and follows_stores:
        problems.append(
            f"{c.where}: a native sidecar's readiness probe counts in its pod's readiness; on /readyz or gRPC "
            "health it takes the engine's pod out of its Services whenever the server's store does not answer"
        )
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for label, path in (
        ("token file", settings.token_file),
        ("shared-memory dir", settings.shm_dir),
        ("upstream token file", settings.upstream_token_file),
        ("upstream CA file", settings.upstream_ca_file),
        ("upstream client certificate", settings.upstream_client_cert),
        ("upstream client key", settings.upstream_client_key),
    ):
        if path is not None and mount_of(c, str(path)) is None:
            problems.append(f"{c.where}: the {label} {path} is on no mounted volume ({sorted(c.mounts)})")
    if settings.shm_dir is not None:
        volume = volumes.get(c.mounts.get(str(settings.shm_dir), ""), {})
        empty_dir = volume.get("emptyDir") or {}
        if empty_dir.get("medium") != "Memory" or "sizeLimit" not in empty_dir:
            problems.append(f"{c.where}: {settings.shm_dir} must be an emptyDir with medium Memory and a sizeLimit")
    return problems


def mount_of(c: Container, path: str) -> str | None:
    """The mount path of c's volume that holds path (the deepest), or None when path is on none of them."""
    holding = [m for m in c.mounts if path == m or path.startswith(m.rstrip("/") + "/")]
    return max(holding, key=len, default=None)


def quantity(text: str | int) -> Decimal:
    """A Kubernetes quantity (72Gi, 100G, 1.5Ti, 1073741824) as a number of bytes."""
    found = _QUANTITY.fullmatch(str(text).strip())
    if found is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    return Decimal(found.group(1)) * _QUANTITY_SUFFIXES[found.group(2) or ""]


def disk_cache_problems(
    c: Container, settings: ServerSettings, siblings: list[Container], pod: dict[str, Any] | None
) -> list[str]:
    """WEIGHTSTREAM_DISK_CACHE is a writable volume of c's own, on disk, with room for WEIGHTSTREAM_DISK_CACHE_BYTES.

    The server serves what it finds there as the files it read, so nothing else may write there: no
    other container of the pod (or other compose service) mounts the volume writable.
    """
    if settings.disk_cache is None:
        return []
    path = str(settings.disk_cache)
    mount = mount_of(c, path)
    if mount is None:
        return [
            f"{c.where}: the disk cache {path} (WEIGHTSTREAM_DISK_CACHE) is on no mounted volume ({sorted(c.mounts)}): "
            "it would be in the container's own filesystem, read-only here, and gone with the container"
        ]
    problems = []
    volume = c.mounts[mount]
    if mount in c.read_only:
        problems.append(f"{c.where}: the disk cache {path} is on {mount}, which is mounted read-only")
    if volume not in ("", "tmpfs"):
        writers = [s.where for s in siblings if any(v == volume and m not in s.read_only for m, v in s.mounts.items())]
        if writers:
            problems.append(
                f"{c.where}: the disk cache's volume {volume} is mounted writable in {', '.join(writers)} too: the "
                "server serves what it finds there, so only the server may write to it"
            )
    if pod is None:
        if volume == "tmpfs":
            problems.append(f"{c.where}: the disk cache {path} is on a tmpfs, which is memory, not disk")
        return problems
    spec = next(v for v in pod.get("volumes", []) if v["name"] == volume)
    return problems + disk_cache_volume_problems(c, settings, spec)


def disk_cache_volume_problems(c: Container, settings: ServerSettings, volume: dict[str, Any]) -> list[str]:
    """The disk cache's Kubernetes volume holds WEIGHTSTREAM_DISK_CACHE_BYTES on disk, writable by the server."""
    name, bound = f"{c.where}: the disk cache's volume {volume['name']}", settings.disk_cache_bytes
    if "emptyDir" in volume:
        empty_dir = volume["emptyDir"] or {}
        if empty_dir.get("medium") == "Memory":
            return [f"{name} is a Memory emptyDir: the cache would be RAM counted against the pod's memory"]
        if "sizeLimit" not in empty_dir:
            return [f"{name} is an emptyDir without a sizeLimit: set one of at least {bound} bytes (the cache's bound)"]
        problems = []
        limit = quantity(empty_dir["sizeLimit"])
        if limit < bound:
            problems.append(
                f"{name} has sizeLimit {empty_dir['sizeLimit']}, less than WEIGHTSTREAM_DISK_CACHE_BYTES ({bound} "
                "bytes): kubelet evicts the whole pod when the cache grows past the limit"
            )
        requested = c.spec.get("resources", {}).get("requests", {}).get("ephemeral-storage")
        if requested is None or quantity(requested) < limit:
            problems.append(
                f"{c.where} requests ephemeral-storage {requested or 'none'}, less than the disk cache's sizeLimit "
                f"{empty_dir['sizeLimit']}: the scheduler may pick a node without that much disk, and under disk "
                "pressure kubelet evicts first the pods that use more than they requested"
            )
        return problems
    if "hostPath" in volume:
        kind = volume["hostPath"].get("type", "")
        if kind != "Directory":
            return [
                f"{name} is a hostPath of type {kind or 'unset'}, not Directory: make the directory on each node for "
                "uid 10001 with mode 0700; kubelet would make it root's, which the server cannot write (fsGroup "
                "does not apply to hostPath)"
            ]
        return []
    if "ephemeral" in volume:
        claim = volume["ephemeral"].get("volumeClaimTemplate", {}).get("spec", {})
        storage = claim.get("resources", {}).get("requests", {}).get("storage")
        if storage is None or quantity(storage) < bound:
            return [f"{name} requests storage {storage or 'none'}, less than WEIGHTSTREAM_DISK_CACHE_BYTES ({bound})"]
        return []
    read_only = [k for k in ("configMap", "secret", "projected", "downwardAPI") if k in volume]
    if read_only:
        return [f"{name} is a {read_only[0]} volume, which is read-only"]
    return []  # a persistentVolumeClaim (its size is the claim's) or another kind these checks do not know


def upstream_credential_problems(c: Container, settings: ServerSettings, pod: dict[str, Any] | None) -> list[str]:
    """A server that reads from an upstream, and from no bucket itself, carries no S3 settings or credentials.

    The upstream's tier holds those; in a server that reads through it they would only let its pod,
    and whatever else runs there, read the buckets directly. (A server may serve buckets of its own
    besides its upstream, WEIGHTSTREAM_S3_BUCKETS; it then needs their credentials.)
    """
    if settings.upstream is None or settings.s3_buckets:
        return []
    carried = [name for name in AWS_CREDENTIAL_ENV if name in c.env]
    carried += sorted(
        env_name(name)
        for name in SERVER_FIELDS
        if name.startswith("s3_") and getattr(settings, name) != ServerSettings.model_fields[name].default
    )
    if pod is not None:
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for volume in (volumes.get(name, {}) for name in c.mounts.values()):
            for source in volume.get("projected", {}).get("sources", []):
                if source.get("serviceAccountToken", {}).get("audience") in AWS_TOKEN_AUDIENCES:
                    carried.append(f"the web-identity token of volume {volume['name']}")
    if not carried:
        return []
    return [
        f"{c.where}: reads from its upstream ({settings.upstream}) and no bucket, yet carries S3 settings or "
        f"credentials ({', '.join(carried)}): the upstream's tier holds them, a server reading through it needs none"
    ]


def upstream_targets(upstream: str) -> list[tuple[str, int | None]]:
    """The (host, port) pairs an --upstream names: HOST:PORT, several comma-separated, or a gRPC dns: name.

    ValueError when the client would refuse the target (several that are not all IP literals of one
    family) or one is not a host; [] for a unix: socket.
    """
    channel_target(upstream)
    text = upstream.strip()
    if text.startswith("unix:"):
        return []
    if text.startswith("dns:"):
        # dns:NAME, dns:///NAME or dns://AUTHORITY/NAME (AUTHORITY: the DNS server to ask).
        name = text[len("dns:") :]
        names = [name[2:].partition("/")[2] if name.startswith("//") else name]
    else:
        names = [n.strip() for n in text.removeprefix("ipv4:").removeprefix("ipv6:").split(",") if n.strip()]
    return [split_host_port(name) for name in names]


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def upstream_security_problems(
    c: Container, settings: ServerSettings, upstream: Container, upstream_settings: ServerSettings
) -> list[str]:
    """c's upstream token and TLS settings meet what its upstream server requires of its callers."""
    problems = []
    if upstream_settings.token_file is not None and settings.upstream_token_file is None:
        problems.append(
            f"{c.where}: its upstream {upstream.where} requires a bearer token (WEIGHTSTREAM_TOKEN_FILE); set "
            "WEIGHTSTREAM_UPSTREAM_TOKEN_FILE to a file holding one"
        )
    if upstream_settings.tls_cert is not None and not settings.upstream_tls:
        problems.append(
            f"{c.where}: its upstream {upstream.where} serves TLS; set WEIGHTSTREAM_UPSTREAM_TLS (and "
            "WEIGHTSTREAM_UPSTREAM_CA_FILE for a private authority)"
        )
    if upstream_settings.tls_cert is None and settings.upstream_tls:
        problems.append(
            f"{c.where}: WEIGHTSTREAM_UPSTREAM_TLS is on, but its upstream {upstream.where} serves plaintext: "
            "every call would fail its handshake"
        )
    if upstream_settings.tls_client_ca is not None and (
        settings.upstream_client_cert is None or settings.upstream_client_key is None
    ):
        problems.append(
            f"{c.where}: its upstream {upstream.where} requires a client certificate (mutual TLS); set "
            "WEIGHTSTREAM_UPSTREAM_CLIENT_CERT and WEIGHTSTREAM_UPSTREAM_CLIENT_KEY"
        )
    return problems


def compose_upstream_problems(c: Container, settings: ServerSettings, containers: list[Container]) -> list[str]:
    """A compose server's upstream names another service that runs the server, at its gRPC port."""
    if settings.upstream is None:
        return []
    try:
        targets = upstream_targets(settings.upstream)
    except ValueError as exc:
        return [f"{c.where}: WEIGHTSTREAM_UPSTREAM {settings.upstream!r}: {exc}"]
    problems = []
    for host, port in targets:
        if "." in host or _is_address(host):
            continue  # outside the compose file: nothing here to check it against
        found = next((x for x in containers if x.host == host), None)
        if found is None or not found.is_server:
            what = "names no service" if found is None else "names a service that does not run `weightstream serve`"
            problems.append(f"{c.where}: the upstream {host} {what} of the compose file")
            continue
        try:
            upstream_settings = server_settings(found)
        except ValueError:
            continue  # said where found itself is checked
        if port is None:
            problems.append(f"{c.where}: the upstream {host} names no port (gRPC would dial 443)")
        elif port != upstream_settings.grpc_port:
            grpc_port = upstream_settings.grpc_port
            problems.append(f"{c.where}: the upstream {host}:{port} is not the gRPC port {grpc_port} of {found.where}")
        problems += upstream_security_problems(c, settings, found, upstream_settings)
    return problems


def security_problems(c: Container, pod: dict[str, Any]) -> list[str]:
    problems = []
    ctx, pod_ctx = c.spec.get("securityContext", {}), pod.get("securityContext", {})
    if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
        problems.append(f"{c.where}: runAsNonRoot is not set")
    if ctx.get("readOnlyRootFilesystem") is not True:
        problems.append(f"{c.where}: readOnlyRootFilesystem is not true")
    if ctx.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{c.where}: allowPrivilegeEscalation is not false")
    if "ALL" not in ctx.get("capabilities", {}).get("drop", []):
        problems.append(f"{c.where}: capabilities are not all dropped")
    for part in ("requests", "limits"):
        missing = {"cpu", "memory"} - set(c.spec.get("resources", {}).get(part, {}))
        if missing:
            problems.append(f"{c.where}: resources.{part} lacks {sorted(missing)}")
    return problems


# --- Helm ---------------------------------------------------------------------------------------

CHART = ROOT / "deploy" / "helm" / "weightstream"

# The monitoring.coreos.com kinds the chart makes, which Kubernetes' own schemas do not hold.
OPERATOR_KINDS = ("ServiceMonitor", "PodMonitor")


def chart_values(name: str) -> dict[str, Any]:
    """The values of one of the chart's ci/NAME-values.yaml files; "default" for none (values.yaml alone)."""
    if name == "default":
        return {}
    values: dict[str, Any] = yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())
    return values


def helm_template(values: dict[str, Any], release: str, namespace: str) -> list[dict[str, Any]]:
    """What `helm template RELEASE deploy/helm/weightstream -n NAMESPACE` renders with values (Helm's Go SDK)."""
    rendered = helm_python.Chart.load(str(CHART)).render(
        values or None, name=release, namespace=namespace, is_install=True
    )
    return [
        doc
        for path, text in sorted(rendered.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def helm_lint(values: dict[str, Any], chart: Path = CHART) -> list[str]:
    """What `helm lint --strict` finds in chart with values: warnings and errors, one line each."""
    report = helm_python.lint(str(chart), values or None, strict=True)
    found = [f"{m['path']}: {m['error']}" for m in report.get("messages", []) if m["severity"] >= 2]
    return found + [str(e) for e in report.get("errors") or []]


# --- Kubernetes ---------------------------------------------------------------------------------


def kustomize_build(overlay: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {overlay.relative_to(ROOT)} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def pod_containers(docs: list[dict[str, Any]], label: str) -> tuple[list[Container], dict[str, dict[str, Any]]]:
    """Every container of every pod template in docs, with env resolved from ConfigMaps and Secrets."""
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    secrets = {
        d["metadata"]["name"]: {**d.get("data", {}), **d.get("stringData", {})} for d in docs if d["kind"] == "Secret"
    }
    containers, pods = [], {}
    for doc in docs:
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        if pod is None:
            continue
        for group in ("initContainers", "containers"):
            for spec in pod.get(group, []):
                where = f"{label}: {doc['kind']}/{doc['metadata']['name']} {group} {spec['name']}"
                env: dict[str, str] = {}
                for source in spec.get("envFrom", []):
                    if "configMapRef" in source:
                        env.update(config_maps[source["configMapRef"]["name"]])
                    else:
                        env.update(secrets[source["secretRef"]["name"]])
                field_refs: dict[str, str] = {}
                for item in spec.get("env", []):
                    ref = item.get("valueFrom", {})
                    if "configMapKeyRef" in ref:
                        env[item["name"]] = config_maps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
                    elif "secretKeyRef" in ref:
                        env[item["name"]] = "from-a-secret"
                    elif "fieldRef" in ref:
                        field_refs[item["name"]] = ref["fieldRef"]["fieldPath"]
                        env[item["name"]] = FIELD_REF_VALUES.get(ref["fieldRef"]["fieldPath"], "from-a-field")
                    else:
                        env[item["name"]] = str(item.get("value", ""))
                argv = weightstream_argv(spec.get("command"), spec.get("args"), spec["image"])
                if argv is not None and argv[:1] == ["serve"] and is_weightstream_image(spec["image"]):
                    # The image's ENV is the server's too, beneath what the manifest sets (compose alike).
                    env = {**dockerfile().env, **env}
                container = Container(
                    where=where,
                    image=spec["image"],
                    argv=argv,
                    env=env,
                    ports={p.get("name", str(p["containerPort"])): p["containerPort"] for p in spec.get("ports", [])},
                    probes={k: spec[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in spec},
                    mounts={m["mountPath"]: m["name"] for m in spec.get("volumeMounts", [])},
                    read_only={m["mountPath"] for m in spec.get("volumeMounts", []) if m.get("readOnly")},
                    spec=spec,
                    field_refs=field_refs,
                    workload=doc,
                )
                containers.append(container)
                pods[where] = pod
    return containers, pods


def all_problems(
    docs: list[dict[str, Any]], label: str, cluster: Mapping[str, list[dict[str, Any]]] | None = None
) -> list[str]:
    """Everything wrong with one overlay's docs; cluster: every overlay's docs by label, as applied together.

    Upstreams are looked for in the cluster (by default, this overlay alone).
    """
    containers, pods = pod_containers(docs, label)
    problems = problems_of(containers, pods)
    for c in containers:
        problems += security_problems(c, pods[c.where])
    for c in containers:
        if not c.is_server:
            continue
        try:
            settings = server_settings(c)
        except ValueError:
            continue  # problems_of has said why
        problems += service_problems(c, settings, docs, label)
        problems += network_policy_problems(c, settings, docs, label)
        problems += advertise_problems(c, settings, docs)
        problems += service_account_problems(c, settings, pods[c.where], docs)
        problems += upstream_problems(c, settings, cluster if cluster is not None else {label: docs})
    return list(dict.fromkeys(problems))


def pod_labels(c: Container) -> dict[str, str]:
    labels: dict[str, str] = c.workload.get("spec", {}).get("template", {}).get("metadata", {}).get("labels", {})
    return labels


def services_of(c: Container, docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Services whose selector picks c's pods."""
    labels = pod_labels(c)
    return [
        d
        for d in docs
        if d["kind"] == "Service" and d["spec"].get("selector") and d["spec"]["selector"].items() <= labels.items()
    ]


def service_problems(c: Container, settings: ServerSettings, docs: list[dict[str, Any]], label: str) -> list[str]:
    """Each Service in front of c targets ports c has, among them the gRPC port and the data port (when on)."""
    problems = []
    for service in services_of(c, docs):
        name = f"{label}: Service/{service['metadata']['name']}"
        targets = set()
        for port in service["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            number = resolve_port(c, target)
            if number is None:
                problems.append(f"{name} targets port {target!r}, which {c.where} does not name ({c.ports})")
            else:
                targets.add(number)
        for what, number in server_ports(settings):
            if what != "REST" and number not in targets:
                problems.append(f"{name} does not carry the {what} port {number} of {c.where}")
    return problems


def _allows(rule: dict[str, Any], c: Container | None, number: int, protocol: str = "TCP") -> bool:
    """Whether a rule's ports let protocol through to port number of c (no ports: every port); named ports are c's."""
    if "ports" not in rule:
        return True
    for entry in rule["ports"]:
        if entry.get("protocol", "TCP") != protocol:
            continue
        if "port" not in entry:
            return True
        port = entry["port"]
        if isinstance(port, str):
            if c is not None and resolve_port(c, port) == number:
                return True
        elif port <= number <= entry.get("endPort", port):
            return True
    return False


def _peers(policy: dict[str, Any], c: Container, number: int) -> set[str]:
    """The sources a NetworkPolicy lets reach c's port number, each peer (pods, namespaces, an IP block) on its own."""
    found: set[str] = set()
    for rule in policy["spec"].get("ingress", []):
        if _allows(rule, c, number):
            # A rule without `from` admits every source.
            found |= {json.dumps(peer, sort_keys=True) for peer in rule.get("from", [{"any": "source"}])}
    return found


def network_policy_problems(
    c: Container, settings: ServerSettings, docs: list[dict[str, Any]], label: str
) -> list[str]:
    """A NetworkPolicy over c's pods lets the data port through from exactly the peers it lets reach gRPC.

    Fewer would cost every load of those clients the data port's connect timeout before it falls
    back to gRPC; more would open the port to clients that can never get a ticket for it.
    """
    if not settings.data_port:
        return []
    labels = pod_labels(c)
    problems = []
    for policy in (d for d in docs if d["kind"] == "NetworkPolicy"):
        selector = policy["spec"].get("podSelector", {}).get("matchLabels", {})
        if not selector.items() <= labels.items() or "Ingress" not in policy["spec"].get("policyTypes", ["Ingress"]):
            continue
        grpc_peers, data_peers = _peers(policy, c, settings.grpc_port), _peers(policy, c, settings.data_port)
        name = f"{label}: NetworkPolicy/{policy['metadata']['name']}"
        if grpc_peers - data_peers:
            problems.append(
                f"{name} lets {sorted(grpc_peers - data_peers)} reach the gRPC port {settings.grpc_port} of "
                f"{c.where} but not its data port {settings.data_port}: their loads would wait for the data "
                "port, then stream over gRPC"
            )
        if data_peers - grpc_peers:
            problems.append(
                f"{name} lets {sorted(data_peers - grpc_peers)} reach the data port {settings.data_port} of "
                f"{c.where} but not its gRPC port {settings.grpc_port}, where tickets are issued"
            )
    return problems


def advertise_problems(c: Container, settings: ServerSettings, docs: list[dict[str, Any]]) -> list[str]:
    """A server with a data port behind a Service, or in several replicas, announces its own pod's IP.

    The data connection must reach the replica that issued its ticket: through a Service (or any
    one address shared by the replicas) it reaches whichever replica is picked, which refuses the
    ticket, and every stream falls back to gRPC.
    """
    replicas = c.workload.get("spec", {}).get("replicas", 1)
    services = [s["metadata"]["name"] for s in services_of(c, docs)]
    if not settings.data_port or (not services and replicas <= 1):
        return []
    source = c.field_refs.get(DATA_ADVERTISE_ENV)
    if source == "status.podIP":
        return []
    got = f"fieldRef {source}" if source else repr(c.env.get(DATA_ADVERTISE_ENV, "unset"))
    return [
        f"{c.where}: {DATA_ADVERTISE_ENV} must be the pod's IP (valueFrom.fieldRef.fieldPath: status.podIP), "
        f"not {got}: behind {', '.join(f'Service/{s}' for s in services) or f'{replicas} replicas'}, a data "
        "connection would reach replicas that did not issue its ticket"
    ]


def service_account_problems(
    c: Container, settings: ServerSettings, pod: dict[str, Any], docs: list[dict[str, Any]]
) -> list[str]:
    """A server with an upstream and no bucket runs under a ServiceAccount that EKS does not give S3 credentials."""
    if settings.upstream is None or settings.s3_buckets:
        return []
    name = pod.get("serviceAccountName", "default")
    for account in docs:
        if account["kind"] == "ServiceAccount" and account["metadata"]["name"] == name:
            if IRSA_ANNOTATION in account["metadata"].get("annotations", {}):
                return [
                    f"{c.where}: reads from its upstream and no bucket, yet its ServiceAccount/{name} has "
                    f"{IRSA_ANNOTATION}: EKS "
                    "injects that role's S3 credentials into every container of the pod"
                ]
    return []


def namespace_of(doc: dict[str, Any]) -> str:
    namespace: str = doc["metadata"].get("namespace", "default")
    return namespace


def matches(selector: dict[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions; {} selects everything) selects labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True


def namespace_labels(namespace: str, cluster: list[dict[str, Any]]) -> dict[str, str]:
    """A namespace's labels: its Namespace object's, if the cluster's docs have it, and the one Kubernetes sets."""
    labels: dict[str, str] = {}
    for doc in cluster:
        if doc["kind"] == "Namespace" and doc["metadata"]["name"] == namespace:
            labels.update(doc["metadata"].get("labels", {}))
    return {**labels, "kubernetes.io/metadata.name": namespace}


def admits(peer: dict[str, Any], policy: dict[str, Any], pod: Container, cluster: list[dict[str, Any]]) -> bool:
    """Whether a NetworkPolicy peer (a `from` or `to` entry) takes in pod's pods; an ipBlock is taken to."""
    if "ipBlock" in peer:
        return True  # which addresses pods get is the cluster's; nothing here says
    if "namespaceSelector" in peer:
        if not matches(peer["namespaceSelector"], namespace_labels(namespace_of(pod.workload), cluster)):
            return False
    elif namespace_of(pod.workload) != namespace_of(policy):
        return False
    return matches(peer.get("podSelector", {}), pod_labels(pod))


def policy_types(policy: dict[str, Any]) -> list[str]:
    """A NetworkPolicy's policyTypes as the API server defaults them."""
    given: list[str] | None = policy["spec"].get("policyTypes")
    return given or ["Ingress", *(["Egress"] if "egress" in policy["spec"] else [])]


def policies_over(pod: Container, kind: str, cluster: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The NetworkPolicies that select pod's pods and restrict their traffic of kind (Ingress or Egress)."""
    return [
        d
        for d in cluster
        if d["kind"] == "NetworkPolicy"
        and namespace_of(d) == namespace_of(pod.workload)
        and matches(d["spec"].get("podSelector", {}), pod_labels(pod))
        and kind in policy_types(d)
    ]


def cluster_service(host: str, namespace: str, cluster: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(namespace, name) of the Service an in-cluster DNS name names, seen from namespace; None for other names.

    NAME (in namespace), NAME.NAMESPACE for a namespace of the cluster, and NAME.NAMESPACE.svc[.DOMAIN].
    """
    labels = host.split(".")
    namespaces = {namespace_of(d) for d in cluster}
    namespaces |= {d["metadata"]["name"] for d in cluster if d["kind"] == "Namespace"}
    if len(labels) == 1:
        return namespace, labels[0]
    if len(labels) == 2 and labels[1] in namespaces:
        return labels[1], labels[0]
    if len(labels) >= 3 and labels[2] == "svc":
        return labels[1], labels[0]
    return None


def upstream_problems(c: Container, settings: ServerSettings, cluster: Mapping[str, list[dict[str, Any]]]) -> list[str]:
    """c's upstream names a headless Service of the cluster at the gRPC port of the servers it selects.

    Headless, so that its DNS name resolves to every ready replica (a Service's one virtual IP would
    put all of c's reads on one connection to one replica); and c meets those servers' token and TLS
    requirements and may reach their gRPC port through the NetworkPolicies on both sides.
    """
    if settings.upstream is None:
        return []
    try:
        targets = upstream_targets(settings.upstream)
    except ValueError as exc:
        return [f"{c.where}: WEIGHTSTREAM_UPSTREAM {settings.upstream!r}: {exc}"]
    every = [doc for docs in cluster.values() for doc in docs]
    problems = []
    for host, port in targets:
        named = None if _is_address(host) else cluster_service(host, namespace_of(c.workload), every)
        if named is None:
            continue  # outside the cluster: nothing here to check it against
        service = next(
            (
                d
                for d in every
                if d["kind"] == "Service" and d["metadata"]["name"] == named[1] and namespace_of(d) == named[0]
            ),
            None,
        )
        if service is None:
            problems.append(f"{c.where}: the upstream {host} names Service {named[0]}/{named[1]}, which no overlay has")
            continue
        name = f"Service {named[0]}/{named[1]}"
        if service["spec"].get("clusterIP") != "None":
            problems.append(
                f"{c.where}: the upstream {host} names {name}, which is not headless (clusterIP: None): its one "
                "virtual IP would put every read on one connection to one replica"
            )
        if port is None:
            problems.append(f"{c.where}: the upstream {host} names no port (gRPC would dial 443)")
            continue
        entry = next((p for p in service["spec"].get("ports", []) if p["port"] == port), None)
        if entry is None:
            ports = [p["port"] for p in service["spec"].get("ports", [])]
            problems.append(f"{c.where}: the upstream {host}:{port}: {name} has no port {port} (its ports: {ports})")
            continue
        servers = [
            (label, server)
            for label, docs in cluster.items()
            for server in pod_containers(docs, label)[0]
            if server.is_server
            and namespace_of(server.workload) == named[0]
            and service["spec"].get("selector")
            and matches({"matchLabels": service["spec"]["selector"]}, pod_labels(server))
        ]
        if not servers:
            problems.append(f"{c.where}: the upstream {host} names {name}, which selects no weightstream server")
        for _, server in servers:
            try:
                upstream_settings = server_settings(server)
            except ValueError:
                continue  # said where the server itself is checked
            target = entry.get("targetPort", entry["port"])
            grpc_port = upstream_settings.grpc_port
            if resolve_port(server, target) != grpc_port:
                problems.append(
                    f"{c.where}: the upstream {host}:{port} leads to port {target!r} of {server.where}, not its gRPC "
                    f"port {grpc_port}"
                )
                continue
            problems += upstream_security_problems(c, settings, server, upstream_settings)
            for policy in policies_over(c, "Egress", every):
                rules = policy["spec"].get("egress", [])
                if not any(
                    _allows(rule, server, grpc_port)
                    and (not rule.get("to") or any(admits(p, policy, server, every) for p in rule["to"]))
                    for rule in rules
                ):
                    problems.append(
                        f"NetworkPolicy/{policy['metadata']['name']} keeps {c.where} from the gRPC port {grpc_port} of "
                        f"its upstream {server.where}: every read from the upstream would time out"
                    )
                if not _is_address(host) and not any(_allows(rule, None, 53, "UDP") for rule in rules):
                    problems.append(
                        f"NetworkPolicy/{policy['metadata']['name']} keeps {c.where} from DNS (UDP port 53): its "
                        f"upstream {host} would not resolve"
                    )
            for policy in policies_over(server, "Ingress", every):
                if not any(
                    _allows(rule, server, grpc_port)
                    and (not rule.get("from") or any(admits(p, policy, c, every) for p in rule["from"]))
                    for rule in policy["spec"].get("ingress", [])
                ):
                    problems.append(
                        f"NetworkPolicy/{policy['metadata']['name']} keeps {c.where} off the gRPC port {grpc_port} of "
                        f"its upstream {server.where}"
                    )
    return problems


# --- docker-compose -----------------------------------------------------------------------------


def compose_schema() -> dict[str, Any]:
    """The Compose specification's schema, as check-jsonschema vendors it (with its license)."""
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value.strip()
    return values


_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: Any, variables: Mapping[str, str]) -> Any:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} and $$, applied throughout a parsed file."""
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        operator, argument = match.group(2), match.group(3)
        given = variables.get(name)
        if operator in (":-", "-"):
            return given if given or (operator == "-" and given is not None) else argument
        if operator in (":?", "?") and not given:
            raise ValueError(f"compose needs {name}: {argument}")
        return given or ""

    return _VARIABLE.sub(replace, value)


def compose_published(service: dict[str, Any]) -> list[tuple[str, str, int]]:
    """A compose service's `ports` as (host IP, host port, container port); "" for what is not given."""
    published = []
    for entry in service.get("ports", []):
        if isinstance(entry, dict):
            host_ip, host_port, target = entry.get("host_ip", ""), str(entry.get("published", "")), entry["target"]
        else:
            # [HOST_IP:][HOST_PORT:]CONTAINER_PORT[/PROTOCOL]
            *front, target = str(entry).split("/")[0].rsplit(":", 2)
            host_ip, host_port = ["", ""][len(front) :] + front
        first, _, last = str(target).partition("-")
        published += [(host_ip, host_port, port) for port in range(int(first), int(last or first) + 1)]
    return published


def compose_mounts(service: dict[str, Any]) -> tuple[dict[str, str], set[str]]:
    """A compose service's mounts as (mount path -> source, the read-only paths); source "tmpfs" for memory,
    "" for an anonymous volume."""
    mounts, read_only = {}, set()
    for entry in service.get("volumes", []):
        if isinstance(entry, dict):
            source = "tmpfs" if entry.get("type") == "tmpfs" else str(entry.get("source", ""))
            target, ro = entry["target"], bool(entry.get("read_only"))
        else:
            # [SOURCE:]TARGET[:MODE]
            parts = str(entry).split(":")
            source, target = (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])
            ro = "ro" in ",".join(parts[2:]).split(",")
        mounts[target] = source
        if ro:
            read_only.add(target)
    tmpfs = service.get("tmpfs", [])
    for entry in [tmpfs] if isinstance(tmpfs, str) else tmpfs:
        mounts[entry.split(":")[0]] = "tmpfs"
    return mounts, read_only


def compose_containers(document: dict[str, Any]) -> list[Container]:
    image_env = dockerfile().env
    containers = []
    for name, service in document["services"].items():
        where = f"docker-compose service {name}"
        environment = service.get("environment", {})
        if isinstance(environment, list):
            environment = dict(item.partition("=")[::2] for item in environment)
        env = {k: str(v) for k, v in environment.items()}
        command = service.get("command")
        entrypoint = service.get("entrypoint")
        if isinstance(command, str):
            command = shlex.split(command)
        if isinstance(entrypoint, str):
            entrypoint = shlex.split(entrypoint)
        image = service.get("image", "")
        if entrypoint is None and "build" in service:
            entrypoint = dockerfile().entrypoint
        argv = weightstream_argv(entrypoint, command, image) if entrypoint or is_weightstream_image(image) else None
        if argv is not None and argv[:1] == ["serve"] and "build" in service:
            # The image's ENV is the server's too; in a client container those variables are inert.
            env = {**image_env, **env}
        test = service.get("healthcheck", {}).get("test")
        probes = {}
        if test:
            found = re.search(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/[a-z]*)", " ".join(test))
            if found and is_weightstream_image(image):
                probes["healthcheck"] = {"httpGet": {"port": int(found.group(1)), "path": found.group(2)}}
        ports = {str(target): target for _, _, target in compose_published(service)}
        ports |= {str(p).split("/")[0]: int(str(p).split("/")[0]) for p in service.get("expose", [])}
        mounts, read_only = compose_mounts(service)
        containers.append(
            Container(
                where=where,
                image=image,
                argv=argv,
                env=env,
                ports=ports,
                probes=probes,
                mounts=mounts,
                read_only=read_only,
                spec=service,
                host=name,
            )
        )
    return containers


# --- Dockerfile ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dockerfile:
    env: dict[str, str]
    entrypoint: list[str]
    exposed: tuple[int, ...]
    healthcheck: list[str]
    user: str


def instructions(text: str) -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    logical = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        logical += line.rstrip()
        if logical.endswith("\\"):
            logical = logical[:-1] + " "
            continue
        if logical.strip():
            keyword, _, rest = logical.strip().partition(" ")
            yield keyword.upper(), rest.strip()
        logical = ""


def dockerfile() -> Dockerfile:
    """What the Dockerfile's final stage gives a container."""
    stages: list[list[tuple[str, str]]] = []
    for keyword, rest in instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            stages.append([])
        elif stages:
            stages[-1].append((keyword, rest))
    env: dict[str, str] = {}
    entrypoint: list[str] = []
    exposed: list[int] = []
    healthcheck: list[str] = []
    user = "0"
    for keyword, rest in stages[-1]:
        if keyword == "ENV":
            env.update(part.split("=", 1) for part in shlex.split(rest))  # type: ignore[misc]
        elif keyword == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif keyword == "EXPOSE":
            exposed += [int(p.split("/")[0]) for p in rest.split()]
        elif keyword == "HEALTHCHECK":
            healthcheck = json.loads(rest[rest.index("CMD") + 3 :])
        elif keyword == "USER":
            user = rest
    return Dockerfile(env, entrypoint, tuple(exposed), healthcheck, user)


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("hadolint"), "--no-color", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
