"""The deployment files' checker: what the manifests, the compose file and the Dockerfile give each container.

The kustomize overlays are rendered with `kubectl kustomize`, the compose file is read with its
variables interpolated, the Dockerfile's final stage is parsed; every container becomes a
Container. problems_of() parses a container's `weightstream` command line and WEIGHTSTREAM_*
variables with the server's own parser and settings, and checks its probes, ports, drain time and
mounts against what those settings say; security_problems() checks its security context and
resources. all_problems() adds what the other objects of an overlay must agree on: the Services and
NetworkPolicies in front of a server carry its gRPC and data ports, and a server behind a Service or
with several replicas announces its own pod IP for the data port. tests/test_deploy.py runs the
checks on the real files and on broken copies of them.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from weightstream.cli import build_parser
from weightstream_server.health import LIVENESS_SERVICE_NAME, SERVICE_NAME
from weightstream_server.settings import ENV_PREFIX, ServerSettings

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

# The host a bulk stream tells its client to dial for the data port.
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


def tool(name: str) -> str:
    """A command-line tool from the project's venv (make test installs them), else from PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: `make test` installs it with the dev extra (pip install -e '.[dev]')")
    return found


def client_env_names() -> set[str]:
    """WEIGHTSTREAM_* names the client reads: the *_ENV constants of weightstream.client (read, not imported)."""
    names = {CLIENT_SHM_ENV}
    for path in (ROOT / "client" / "weightstream" / "client").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                value = node.value.value
                if isinstance(value, str) and value.startswith(ENV_PREFIX):
                    if any(isinstance(t, ast.Name) and t.id.endswith("_ENV") for t in node.targets):
                        names.add(value)
    return names


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
    mounts: dict[str, str] = field(default_factory=dict)  # mount path -> volume name
    spec: dict[str, Any] = field(default_factory=dict)  # the raw Kubernetes container
    field_refs: dict[str, str] = field(default_factory=dict)  # env name -> downward API fieldPath
    workload: dict[str, Any] = field(default_factory=dict)  # the raw Deployment (or other) holding the pod

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


def parse_cli(argv: list[str], where: str) -> argparse.Namespace:
    """argv parsed by `weightstream`'s own parser; ValueError naming where and why when it refuses."""
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            return build_parser().parse_args(argv)
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
    """Everything wrong with these containers, one sentence each; pods maps a container's where to its pod."""
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
        if pods is not None:
            problems += pod_problems(c, settings, pods[c.where])
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
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for label, path in (("token file", settings.token_file), ("shared-memory dir", settings.shm_dir)):
        if path is not None and not any(str(path).startswith(m.rstrip("/") + "/") or str(path) == m for m in c.mounts):
            problems.append(f"{c.where}: the {label} {path} is on no mounted volume ({sorted(c.mounts)})")
    if settings.shm_dir is not None:
        volume = volumes.get(c.mounts.get(str(settings.shm_dir), ""), {})
        empty_dir = volume.get("emptyDir") or {}
        if empty_dir.get("medium") != "Memory" or "sizeLimit" not in empty_dir:
            problems.append(f"{c.where}: {settings.shm_dir} must be an emptyDir with medium Memory and a sizeLimit")
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
                container = Container(
                    where=where,
                    image=spec["image"],
                    argv=weightstream_argv(spec.get("command"), spec.get("args"), spec["image"]),
                    env=env,
                    ports={p.get("name", str(p["containerPort"])): p["containerPort"] for p in spec.get("ports", [])},
                    probes={k: spec[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in spec},
                    mounts={m["mountPath"]: m["name"] for m in spec.get("volumeMounts", [])},
                    spec=spec,
                    field_refs=field_refs,
                    workload=doc,
                )
                containers.append(container)
                pods[where] = pod
    return containers, pods


def all_problems(docs: list[dict[str, Any]], label: str) -> list[str]:
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
    return problems


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


def _allows(rule: dict[str, Any], c: Container, number: int) -> bool:
    """Whether an ingress rule's ports let TCP through to c's port number (no ports: every port)."""
    if "ports" not in rule:
        return True
    for entry in rule["ports"]:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in entry:
            return True
        port = entry["port"]
        if isinstance(port, str):
            if resolve_port(c, port) == number:
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
        containers.append(Container(where=where, image=image, argv=argv, env=env, ports=ports, probes=probes))
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
