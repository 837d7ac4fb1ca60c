"""Deployment files, checked offline: Dockerfile, docker-compose and the kustomize overlays.

No Docker engine or cluster runs here, so nothing is started: the overlays are built with kustomize
(`kubectl kustomize`) and validated against the Kubernetes schemas (kubernetes-validate), the
compose file against the Compose specification's schema (as vendored by check-jsonschema), the
Dockerfile with hadolint. On top of that, every `weightstream` command line and every WEIGHTSTREAM_*
variable the files give a container is parsed by the server's own parser and settings, and probes,
ports, drain time and security settings are checked against what those settings say. The checker
is tests/support/deploy_checks.py; these tests run it on the real files and on broken copies.
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.deploy_checks import (
    CLIENT_SHM_ENV,
    COMPOSE_FILE,
    DATA_ADVERTISE_ENV,
    DOCKERFILE,
    KUBERNETES_VERSIONS,
    OVERLAYS,
    ROOT,
    Container,
    all_problems,
    compose_containers,
    compose_published,
    compose_schema,
    dockerfile,
    env_example,
    hadolint,
    instructions,
    interpolate,
    kustomize_build,
    parse_cli,
    pod_containers,
    problems_of,
    server_settings,
)
from tests.support.ports import free_ports
from tests.support.s3_stores import S3RVER_KEY, S3Process
from tests.support.servers import serving
from weightstream.demo import llama_like_state_dict
from weightstream_server.settings import ServerSettings

# --- Kubernetes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict[str, Any]]]:
    assert {p.name for p in OVERLAYS} >= {"sidecar", "shared"}, f"overlays found: {OVERLAYS}"
    return {overlay.name: kustomize_build(overlay) for overlay in OVERLAYS}


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
    # The data port serves the engine over loopback (its target's host); other pods reach neither it nor gRPC.
    assert settings.data_port and server.ports.get("data") == settings.data_port
    assert settings.data_advertise is None
    (policy,) = (d for d in built["sidecar"] if d["kind"] == "NetworkPolicy")
    opened = {p.get("port") for rule in policy["spec"]["ingress"] for p in rule.get("ports", [{}])}
    assert opened.isdisjoint({None, settings.grpc_port, settings.data_port, "grpc", "data"}), opened
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


def test_shared_service_announces_each_pods_own_ip_for_the_data_port(built: dict[str, list[dict[str, Any]]]) -> None:
    docs = built["shared"]
    containers, _ = pod_containers(docs, "shared")
    server = next(c for c in containers if c.is_server)
    settings = server_settings(server)
    assert settings.data_port == ServerSettings.model_fields["data_port"].default
    assert server.ports["data"] == settings.data_port
    assert server.field_refs[DATA_ADVERTISE_ENV] == "status.podIP"
    for service in (d for d in docs if d["kind"] == "Service"):
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports["data"]["port"] == settings.data_port and ports["data"]["targetPort"] == "data", service


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

    assert any("WEIGHTSTREAM_GRPC_PORT: 'fifty' is not an integer" in p for p in shared_problems(built, bad_value))
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


def test_checker_rejects_a_data_port_the_manifests_do_not_carry(built: dict[str, list[dict[str, Any]]]) -> None:
    def config(docs: list[dict[str, Any]]) -> dict[str, str]:
        data: dict[str, str] = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
        return data

    def headless_without_it(docs: list[dict[str, Any]], _pod: dict[str, Any], _c: dict[str, Any]) -> None:
        headless = next(d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None")
        headless["spec"]["ports"] = [p for p in headless["spec"]["ports"] if p["name"] != "data"]

    def another_port(docs: list[dict[str, Any]], _pod: dict[str, Any], _c: dict[str, Any]) -> None:
        config(docs)["WEIGHTSTREAM_DATA_PORT"] = "50053"

    def off(docs: list[dict[str, Any]], _pod: dict[str, Any], c: dict[str, Any]) -> None:
        config(docs)["WEIGHTSTREAM_DATA_PORT"] = "0"
        del c["env"]

    problems = shared_problems(built, headless_without_it)
    assert any("Service/weightstream-headless does not carry the data port 50052" in p for p in problems), problems
    problems = shared_problems(built, another_port)
    assert any("the data port 50053 is not among the container's ports" in p for p in problems), problems
    assert any("Service/weightstream does not carry the data port 50053" in p for p in problems), problems
    # With the data port off, nothing needs to carry it or announce it.
    assert shared_problems(built, off) == []


def test_checker_rejects_a_shared_data_address(built: dict[str, list[dict[str, Any]]]) -> None:
    def unset(_docs: list[dict[str, Any]], _pod: dict[str, Any], c: dict[str, Any]) -> None:
        del c["env"]

    def service_name(_docs: list[dict[str, Any]], _pod: dict[str, Any], c: dict[str, Any]) -> None:
        c["env"] = [{"name": DATA_ADVERTISE_ENV, "value": "weightstream"}]

    def node_ip(_docs: list[dict[str, Any]], _pod: dict[str, Any], c: dict[str, Any]) -> None:
        advertise = next(e for e in c["env"] if e["name"] == DATA_ADVERTISE_ENV)
        advertise["valueFrom"]["fieldRef"]["fieldPath"] = "status.hostIP"

    for change, said in (
        (unset, "not 'unset'"),
        (service_name, "not 'weightstream'"),
        (node_ip, "fieldRef status.hostIP"),
    ):
        problems = shared_problems(built, change)
        assert len(problems) == 1 and f"{DATA_ADVERTISE_ENV} must be the pod's IP" in problems[0], problems
        assert said in problems[0] and "Service/weightstream" in problems[0], problems


def test_checker_requires_a_network_policy_to_treat_the_data_port_as_grpc(
    built: dict[str, list[dict[str, Any]]],
) -> None:
    """The shared base has no NetworkPolicy (who its clients are is the cluster's to say); these add one."""
    engines = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "inference"}}}

    def policy(*ports: int | str) -> Any:
        document = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "weightstream", "namespace": "weightstream"},
            "spec": {
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "weightstream"}},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [engines], "ports": [{"port": port, "protocol": "TCP"} for port in ports]}],
            },
        }
        kubernetes_validate.validate(document, KUBERNETES_VERSIONS[-1], strict=True)

        def add(docs: list[dict[str, Any]], _pod: dict[str, Any], _c: dict[str, Any]) -> None:
            docs.append(document)

        return add

    problems = shared_problems(built, policy("grpc", "http"))
    assert len(problems) == 1, problems
    assert "NetworkPolicy/weightstream lets" in problems[0] and "reach the gRPC port 50051" in problems[0]
    assert "but not its data port 50052" in problems[0]
    problems = shared_problems(built, policy(50052))
    assert any("reach the data port 50052" in p and "but not its gRPC port" in p for p in problems), problems
    assert shared_problems(built, policy("grpc", 50052)) == []


# --- docker-compose -----------------------------------------------------------------------------


def test_compose_file_matches_the_compose_specification() -> None:
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    errors = sorted(jsonschema.Draft202012Validator(compose_schema()).iter_errors(document), key=str)
    assert [f"{list(e.absolute_path)}: {e.message}" for e in errors] == []


def test_compose_schema_rejects_a_misspelt_key() -> None:
    document = yaml.safe_load(COMPOSE_FILE.read_text())
    document["services"]["demo-client"]["depend_on"] = document["services"]["demo-client"].pop("depends_on")
    errors = list(jsonschema.Draft202012Validator(compose_schema()).iter_errors(document))
    assert any("depend_on" in e.message for e in errors), [e.message for e in errors]


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
    # No advertised host: the demo client dials its target's host (the service name) with the data port.
    assert settings.data_port and settings.data_advertise is None
    published = compose_published(services["weightstream"])
    assert {settings.grpc_port, settings.data_port, settings.http_port} <= {target for _, _, target in published}
    assert {host_ip for host_ip, _, _ in published} == {"127.0.0.1"}, published
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
    document = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env_example())
    document["services"]["weightstream"]["environment"]["WEIGHTSTREAM_DATA_PORT"] = "50053"
    problems = problems_of(compose_containers(document))
    assert any("the data port 50053 is not among the container's ports" in p for p in problems), problems


# --- Dockerfile ---------------------------------------------------------------------------------


def test_dockerfile_runs_the_server_as_configured() -> None:
    image = dockerfile()
    assert image.entrypoint[:2] == ["weightstream", "serve"]
    container = Container(where="Dockerfile", image="weightstream", argv=image.entrypoint[1:], env=image.env)
    settings = server_settings(container)
    assert settings.host == "0.0.0.0", "a server in a container must listen on every interface"
    assert settings.data_port == ServerSettings.model_fields["data_port"].default
    assert {settings.grpc_port, settings.data_port, settings.http_port} <= set(image.exposed)
    command = " ".join(image.healthcheck)
    assert "/healthz" in command and "WEIGHTSTREAM_HTTP_PORT" in command and f"'{settings.http_port}'" in command
    uid = image.user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {image.user}: the image must run as a numeric non-root user"


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


@pytest.mark.slow
def test_compose_steps_run_against_a_real_s3_store(s3_store: S3Process, tmp_path: Path) -> None:
    """The compose stack's three steps as real processes, on s3rver in place of MinIO (no Docker here).

    The upload job's script and the demo client's command line are run as the compose file gives
    them, and the server with the compose file's settings; only the addresses (minio:9000,
    weightstream:50051) and ports are this machine's. The client's tensors come over the data port.
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
    (data_port,) = free_ports(1)
    settings = server_settings(server_container).model_copy(
        update={
            "host": "127.0.0.1",
            "grpc_port": 0,
            "http_port": 0,
            "data_port": data_port,
            "s3_endpoint": s3_store.endpoint,
            "model_root": tmp_path,
        }
    )
    with serving(settings) as server:
        argv = [a.replace("weightstream:50051", f"127.0.0.1:{server.port}") for a in services["demo-client"]["command"]]
        result = subprocess.run(
            [sys.executable, "-m", "weightstream", *argv], capture_output=True, text=True, timeout=120, check=False
        )
    assert result.returncode == 0, result.stdout + result.stderr
    state = llama_like_state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert f"loaded s3://{bucket}/{model}" in result.stdout
    assert f"{len(state)} tensors, {total:,d} bytes" in result.stdout, result.stdout
    assert "over tcp" in result.stdout, result.stdout
