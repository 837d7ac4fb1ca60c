"""Deployment files, checked offline: Dockerfile, docker-compose and the kustomize overlays.

No Docker engine or cluster runs here, so nothing is started: the overlays are built with kustomize
(`kubectl kustomize`) and validated against the Kubernetes schemas (kubernetes-validate), the
compose file against the Compose specification's schema (as vendored by check-jsonschema), the
Dockerfile with hadolint. On top of that, every `weightstream` command line and every WEIGHTSTREAM_*
variable the files give a container is parsed by the server's own parser and settings, and probes,
ports, drain time and security settings are checked against what those settings say.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import dataclasses
import difflib
import io
import json
import os
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

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.s3_servers import S3RVER_KEY, S3Process
from weightstream.cli import SERVE_OPTIONS, build_parser
from weightstream.demo import llama_like_state_dict
from weightstream_server import create_server
from weightstream_server.health import LIVENESS_SERVICE_NAME, SERVICE_NAME
from weightstream_server.settings import ENV_PREFIX, ServerSettings

ROOT = Path(__file__).resolve().parent.parent
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
SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerSettings)}


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
    given = {name: getattr(namespace, name) for _flag, name, _kind, _text in SERVE_OPTIONS}
    try:
        return ServerSettings.load(given, container.env)
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
        for name, port in (("gRPC", settings.grpc_port), ("REST", settings.http_port)):
            if port not in c.ports.values():
                problems.append(f"{c.where}: the {name} port {port} is not among the container's ports {c.ports}")
    return problems


def resolve_port(c: Container, port: int | str) -> int | None:
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


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict[str, Any]]]:
    assert {p.name for p in OVERLAYS} >= {"sidecar", "shared"}, f"overlays found: {OVERLAYS}"
    return {overlay.name: kustomize_build(overlay) for overlay in OVERLAYS}


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
                for item in spec.get("env", []):
                    ref = item.get("valueFrom", {})
                    if "configMapKeyRef" in ref:
                        env[item["name"]] = config_maps[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
                    elif "secretKeyRef" in ref:
                        env[item["name"]] = "from-a-secret"
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
                )
                containers.append(container)
                pods[where] = pod
    return containers, pods


def all_problems(docs: list[dict[str, Any]], label: str) -> list[str]:
    containers, pods = pod_containers(docs, label)
    problems = problems_of(containers, pods)
    for c in containers:
        problems += security_problems(c, pods[c.where])
    return problems


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_overlays_are_valid_kubernetes(built: dict[str, list[dict[str, Any]]], version: str) -> None:
    for name, docs in built.items():
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"overlay {name}: {doc['kind']}/{doc['metadata']['name']} is not valid Kubernetes {version}: {exc}"
                )


def test_kubernetes_validation_rejects_a_misspelt_field(built: dict[str, list[dict[str, Any]]]) -> None:
    deployment = copy.deepcopy(next(d for d in built["shared"] if d["kind"] == "Deployment"))
    context = deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    context["readOnlyRootFileSystem"] = context.pop("readOnlyRootFilesystem")
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFileSystem"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_manifests_use_only_what_the_server_accepts(built: dict[str, list[dict[str, Any]]]) -> None:
    checked_servers = 0
    for name, docs in built.items():
        assert all_problems(docs, f"overlay {name}") == []
        checked_servers += sum(c.is_server for c in pod_containers(docs, name)[0])
    assert checked_servers == 2, "one server container in each overlay was expected"


def test_sidecar_is_native_and_shares_memory_with_the_engine(built: dict[str, list[dict[str, Any]]]) -> None:
    containers, pods = pod_containers(built["sidecar"], "sidecar")
    server = next(c for c in containers if c.is_server)
    engine = next(c for c in containers if c.spec["name"] == "engine")
    assert server.spec.get("restartPolicy") == "Always", "the sidecar must be a native sidecar (restartPolicy: Always)"
    assert "initContainers" in server.where
    settings = server_settings(server)
    assert settings.shm_dir is not None, "the sidecar overlay turns the shared-memory path on"
    assert engine.env.get(CLIENT_SHM_ENV) == str(settings.shm_dir)
    # The same volume at the same path in both: the client proves it sees what the server sees.
    assert engine.mounts.get(str(settings.shm_dir)) == server.mounts[str(settings.shm_dir)]
    host, _, port = engine.env["WEIGHTSTREAM_TARGET"].rpartition(":")
    assert host in ("127.0.0.1", "localhost") and int(port) == settings.grpc_port
    token = pods[server.where]["volumes"]
    assert any("serviceAccountToken" in s for v in token if "projected" in v for s in v["projected"]["sources"])
    assert {"AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE"} <= set(server.env)


def test_shared_service_has_its_parts(built: dict[str, list[dict[str, Any]]]) -> None:
    docs = built["shared"]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "Secret"} <= {k for k, _ in kinds}
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] >= 2
    services = [d for d in docs if d["kind"] == "Service"]
    assert any(s["spec"].get("clusterIP") == "None" for s in services), "a headless Service is missing"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selecting in [*services, *(d for d in docs if d["kind"] == "PodDisruptionBudget")]:
        selector = selecting["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert selector.items() <= labels.items(), f"{selecting['metadata']['name']} selects no pod of the Deployment"
    containers, _ = pod_containers(docs, "shared")
    settings = server_settings(next(c for c in containers if c.is_server))
    assert settings.token_file is not None, "the shared service needs tokens"


def shared_problems(built: dict[str, list[dict[str, Any]]], change: Any) -> list[str]:
    docs = copy.deepcopy(built["shared"])
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    change(docs, deployment["spec"]["template"]["spec"], deployment["spec"]["template"]["spec"]["containers"][0])
    return all_problems(docs, "shared")


def test_checker_rejects_a_misspelt_variable(built: dict[str, list[dict[str, Any]]]) -> None:
    def misspell(docs: list[dict[str, Any]], _pod: dict[str, Any], _c: dict[str, Any]) -> None:
        data = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
        data["WEIGHTSTREAM_DRAIN_SECOND"] = data.pop("WEIGHTSTREAM_DRAIN_SECONDS")

    problems = shared_problems(built, misspell)
    assert len(problems) == 1 and "WEIGHTSTREAM_DRAIN_SECOND is not a setting" in problems[0], problems
    assert "did you mean WEIGHTSTREAM_DRAIN_SECONDS" in problems[0]


def test_checker_rejects_a_bad_value_and_an_unknown_flag(built: dict[str, list[dict[str, Any]]]) -> None:
    def bad_value(docs: list[dict[str, Any]], _pod: dict[str, Any], _c: dict[str, Any]) -> None:
        next(d for d in docs if d["kind"] == "ConfigMap")["data"]["WEIGHTSTREAM_GRPC_PORT"] = "fifty"

    def unknown_flag(_docs: list[dict[str, Any]], _pod: dict[str, Any], container: dict[str, Any]) -> None:
        container["args"] = ["--grpc-prot", "50051"]

    assert any("WEIGHTSTREAM_GRPC_PORT='fifty' is not an integer" in p for p in shared_problems(built, bad_value))
    assert any("--grpc-prot" in p and "not accepted" in p for p in shared_problems(built, unknown_flag))


def test_checker_rejects_wrong_probes_and_a_short_grace(built: dict[str, list[dict[str, Any]]]) -> None:
    def wrong_port(_docs: list[dict[str, Any]], _pod: dict[str, Any], c: dict[str, Any]) -> None:
        c["readinessProbe"]["grpc"]["port"] = 8080

    def readiness_as_liveness(_docs: list[dict[str, Any]], _pod: dict[str, Any], c: dict[str, Any]) -> None:
        c["livenessProbe"] = {"grpc": {"port": 50051}}

    def short_grace(_docs: list[dict[str, Any]], pod: dict[str, Any], _c: dict[str, Any]) -> None:
        pod["terminationGracePeriodSeconds"] = 30

    def loopback(docs: list[dict[str, Any]], _pod: dict[str, Any], _c: dict[str, Any]) -> None:
        next(d for d in docs if d["kind"] == "ConfigMap")["data"]["WEIGHTSTREAM_HOST"] = "127.0.0.1"

    assert any("probes gRPC port 8080" in p for p in shared_problems(built, wrong_port))
    assert any("livenessProbe must be GET /healthz" in p for p in shared_problems(built, readiness_as_liveness))
    assert any("does not exceed the preStop sleep (5 s) plus" in p for p in shared_problems(built, short_grace))
    assert any("cannot reach a server on host 127.0.0.1" in p for p in shared_problems(built, loopback))


# --- docker-compose -----------------------------------------------------------------------------


def compose_schema() -> dict[str, Any]:
    """The Compose specification's schema, as check-jsonschema vendors it (with its license)."""
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def test_compose_file_matches_the_compose_specification() -> None:
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    errors = sorted(jsonschema.Draft202012Validator(compose_schema()).iter_errors(document), key=str)
    assert [f"{list(e.absolute_path)}: {e.message}" for e in errors] == []


def test_compose_schema_rejects_a_misspelt_key() -> None:
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    document["services"]["demo-client"]["depend_on"] = document["services"]["demo-client"].pop("depends_on")
    errors = list(jsonschema.Draft202012Validator(compose_schema()).iter_errors(document))
    assert any("depend_on" in e.message for e in errors), [e.message for e in errors]


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
        containers.append(Container(where=where, image=image, argv=argv, env=env, probes=probes))
    return containers


def test_compose_uses_only_what_the_server_accepts_and_starts_in_order() -> None:
    document = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env_example())
    containers = compose_containers(document)
    assert problems_of(containers) == []
    services = document["services"]
    servers = [c for c in containers if c.is_server]
    assert [c.where for c in servers] == ["docker-compose service weightstream"]
    settings = server_settings(servers[0])
    assert servers[0].probes, "the weightstream service needs a health check on /readyz or /healthz"
    for name, service in services.items():
        for needed, condition in service.get("depends_on", {}).items():
            assert needed in services, f"{name} depends on a service {needed} that does not exist"
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[needed], (
                    f"{name} waits for {needed} to be healthy; it has no healthcheck"
                )
            if condition["condition"] == "service_completed_successfully":
                assert services[needed].get("restart", "no") == "no", f"{needed} is a job; it must not restart"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_FILE.parent / source).exists(), f"{name} mounts {source}, which is not in deploy/"
    client = next(c for c in containers if c.where.endswith("demo-client"))
    assert client.argv is not None
    namespace = parse_cli(client.argv, client.where)
    host, _, port = namespace.target.rpartition(":")
    assert host == "weightstream" and int(port) == settings.grpc_port
    assert namespace.model.removeprefix("s3://").split("/")[0] in settings.s3_buckets
    assert services["demo-client"]["depends_on"]["weightstream"]["condition"] == "service_healthy"


def test_compose_checker_rejects_a_misspelt_variable_and_a_wrong_port() -> None:
    document = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env_example())
    environment = document["services"]["weightstream"]["environment"]
    environment["WEIGHTSTREAM_S3_BUCKET"] = environment.pop("WEIGHTSTREAM_S3_BUCKETS")
    problems = problems_of(compose_containers(document))
    assert any("WEIGHTSTREAM_S3_BUCKET is not a setting" in p for p in problems), problems
    document = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env_example())
    document["services"]["weightstream"]["environment"]["WEIGHTSTREAM_HTTP_PORT"] = "8081"
    problems = problems_of(compose_containers(document))
    assert any("probes HTTP port 8080, the server's REST port is 8081" in p for p in problems), problems


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


def test_dockerfile_runs_the_server_as_configured() -> None:
    image = dockerfile()
    assert image.entrypoint[:2] == ["weightstream", "serve"]
    container = Container(where="Dockerfile", image="weightstream", argv=image.entrypoint[1:], env=image.env)
    settings = server_settings(container)
    assert settings.host == "0.0.0.0", "a server in a container must listen on every interface"
    assert {settings.grpc_port, settings.http_port} <= set(image.exposed)
    command = " ".join(image.healthcheck)
    assert "/healthz" in command and "WEIGHTSTREAM_HTTP_PORT" in command and f"'{settings.http_port}'" in command
    uid = image.user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {image.user}: the image must run as a numeric non-root user"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("hadolint"), "--no-color", str(path)], capture_output=True, text=True, timeout=60, check=False
    )


def test_hadolint_passes_the_dockerfile() -> None:
    result = hadolint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nRUN cd /src && pip install .\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert {"DL3007", "DL3008", "DL3003"} <= set(re.findall(r"DL\d{4}", result.stdout)), result.stdout


def test_dockerignore_keeps_the_context_small() -> None:
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    assert "*" in lines, "the build context should be an allow-list"
    copied = {
        rest.split()[0] for k, rest in instructions(DOCKERFILE.read_text()) if k == "COPY" and "--from" not in rest
    }
    for source in copied:
        assert f"!{source.rstrip('/')}/" in lines or f"!{source}" in lines, (
            f"COPY {source} is not let through .dockerignore"
        )


# --- the compose stack's steps, run without Docker ----------------------------------------------


def test_compose_steps_run_against_a_real_s3_store(s3_store: S3Process, tmp_path: Path) -> None:
    """The compose stack's three steps as real processes, on s3rver in place of MinIO (no Docker here).

    The upload job's script and the demo client's command line are run as the compose file gives
    them, and the server with the compose file's settings; only the addresses (minio:9000,
    weightstream:50051) and ports are this machine's.
    """
    document = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env_example())
    services = document["services"]
    job = services["upload-demo"]
    script = COMPOSE_FILE.parent / job["volumes"][0].split(":")[0]
    env = {**os.environ, **{k: str(v) for k, v in job["environment"].items()}}
    env.update(AWS_ENDPOINT_URL=s3_store.endpoint, AWS_ACCESS_KEY_ID=S3RVER_KEY, AWS_SECRET_ACCESS_KEY=S3RVER_KEY)
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    bucket, model = env["DEMO_BUCKET"], env["DEMO_MODEL"]
    assert f"demo checkpoint ready: s3://{bucket}/{model}" in result.stdout

    server_container = next(c for c in compose_containers(document) if c.is_server)
    settings = dataclasses.replace(
        server_settings(server_container),
        host="127.0.0.1",
        grpc_port=0,
        http_port=0,
        s3_endpoint=s3_store.endpoint,
        model_root=tmp_path,
    )
    server = create_server(settings)
    server.start()
    try:
        argv = [a.replace("weightstream:50051", f"127.0.0.1:{server.port}") for a in services["demo-client"]["command"]]
        result = subprocess.run(
            [sys.executable, "-m", "weightstream", *argv], capture_output=True, text=True, timeout=120, check=False
        )
    finally:
        server.stop(grace=1.0)
    assert result.returncode == 0, result.stdout + result.stderr
    state = llama_like_state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert f"loaded s3://{bucket}/{model}" in result.stdout
    assert f"{len(state)} tensors, {total:,d} bytes" in result.stdout, result.stdout
