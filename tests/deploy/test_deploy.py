"""Deployment files, checked offline: Dockerfile, docker-compose and the kustomize overlays.

No Docker engine or cluster runs here, so nothing is started: the overlays are built with kustomize
(`kubectl kustomize`) and validated against the Kubernetes schemas (kubernetes-validate), the
compose file against the Compose specification's schema (as vendored by check-jsonschema), the
Dockerfile with hadolint. On top of that, every `weightstream` command line and every WEIGHTSTREAM_*
variable the files give a container is parsed by the server's own parser and settings, and probes,
ports, drain time and security settings are checked against what those settings say. The checker
is tests/deploy/checks.py; these tests run it on the real files and on broken copies.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.checks import (
    AWS_CREDENTIAL_ENV,
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
    quantity,
    server_settings,
    upstream_targets,
)
from tests.support.ports import free_ports
from tests.support.s3_stores import S3RVER_KEY, S3Process
from tests.support.servers import serving
from weightstream.samples import llama_like_state_dict
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


# The shared service on GKE or AKS: applied instead of overlays/shared, never beside it.
CLOUD_OVERLAYS = {"gke", "aks"}


def cluster_of(built: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """The docs of the overlays applied together to one cluster (sidecar and shared), by label."""
    return {f"overlay {name}": docs for name, docs in built.items() if name not in CLOUD_OVERLAYS}


def test_manifests_use_only_what_the_server_accepts(built: dict[str, list[dict[str, Any]]]) -> None:
    checked_servers = 0
    for name, docs in built.items():
        assert all_problems(docs, f"overlay {name}", cluster_of(built)) == []
        checked_servers += sum(c.is_server for c in pod_containers(docs, name)[0])
    assert checked_servers == len(built), "one server container in each overlay was expected"


@pytest.mark.parametrize(
    ("overlay", "store", "identity"),
    [
        ("gke", "gcs_buckets", "iam.gke.io/gcp-service-account"),
        ("aks", "azure_containers", "azure.workload.identity/client-id"),
    ],
)
def test_cloud_overlays_serve_their_store_by_workload_identity(
    built: dict[str, list[dict[str, Any]]], overlay: str, store: str, identity: str
) -> None:
    """GKE and AKS: the shared service on the cloud's own store, with the cloud's workload identity and no AWS part."""
    containers, _ = pod_containers(built[overlay], overlay)
    server = next(c for c in containers if c.is_server)
    settings = server_settings(server)
    assert getattr(settings, store) == ("models",) and settings.s3_buckets == ()
    assert not any(name.startswith("AWS_") for name in server.env), server.env
    (account,) = (d for d in built[overlay] if d["kind"] == "ServiceAccount")
    annotations = account["metadata"].get("annotations", {})
    assert identity in annotations and not any(k.startswith("eks.amazonaws.com") for k in annotations)
    text = json.dumps(built[overlay])
    assert "aws-token" not in text and "sts.amazonaws.com" not in text
    if overlay == "aks":
        deployment = next(d for d in built[overlay] if d["kind"] == "Deployment")
        assert deployment["spec"]["template"]["metadata"]["labels"].get("azure.workload.identity/use") == "true"
        config = next(d for d in built[overlay] if d["kind"] == "ConfigMap")
        assert config["data"]["AZURE_STORAGE_ACCOUNT_NAME"]


def test_sidecar_is_native_and_shares_memory_with_the_engine(built: dict[str, list[dict[str, Any]]]) -> None:
    containers, _ = pod_containers(built["sidecar"], "sidecar")
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


def test_sidecar_reads_from_the_shared_service_into_a_disk_cache(built: dict[str, list[dict[str, Any]]]) -> None:
    containers, pods = pod_containers(built["sidecar"], "sidecar")
    server = next(c for c in containers if c.is_server)
    settings = server_settings(server)
    # The shared overlay's headless Service, by its full name, at its gRPC port.
    shared = next(c for c in pod_containers(built["shared"], "shared")[0] if c.is_server)
    shared_settings = server_settings(shared)
    headless = next(d for d in built["shared"] if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None")
    namespace = headless["metadata"]["namespace"]
    grpc = next(p for p in headless["spec"]["ports"] if p["targetPort"] == "grpc")
    name = f"{headless['metadata']['name']}.{namespace}.svc.cluster.local"
    assert settings.upstream == f"dns:///{name}:{grpc['port']}"
    assert upstream_targets(settings.upstream) == [(name, shared_settings.grpc_port)]
    # It holds nothing itself: no model root (the image's is emptied), no bucket, no S3 credentials.
    assert settings.model_root is None and settings.s3_buckets == ()
    assert not {"AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ACCESS_KEY_ID"} & set(server.env)
    pod = pods[server.where]
    assert not [v for v in pod["volumes"] if "projected" in v], "no web-identity token in the sidecar's pod"
    account = next(d for d in built["sidecar"] if d["kind"] == "ServiceAccount")
    assert "eks.amazonaws.com/role-arn" not in account["metadata"].get("annotations", {})
    # The shared service requires a token: the sidecar's Secret holds one of the shared service's.
    assert shared_settings.token_file is not None and settings.upstream_token_file is not None
    secret_volume = server.mounts[str(settings.upstream_token_file.parent)]
    secret_name = next(v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == secret_volume)
    secrets = {d["metadata"]["name"]: d for d in [*built["sidecar"], *built["shared"]] if d["kind"] == "Secret"}
    token = secrets[secret_name]["stringData"][settings.upstream_token_file.name].splitlines()[0].strip()
    shared_tokens = next(iter(secrets["weightstream-tokens"]["stringData"].values())).splitlines()
    assert token in [line.strip() for line in shared_tokens if not line.startswith("#")]
    # The models the engine asks for are in a bucket of the shared service.
    engine = next(c for c in containers if c.spec["name"] == "engine")
    assert engine.env["WEIGHTSTREAM_MODEL"].removeprefix("s3://").split("/")[0] in shared_settings.s3_buckets
    # The disk cache: an emptyDir of the server's alone, bounded above the cache's own bound.
    assert settings.disk_cache is not None
    volume_name = server.mounts[str(settings.disk_cache)]
    volume = next(v for v in pod["volumes"] if v["name"] == volume_name)
    assert "medium" not in volume["emptyDir"]
    assert quantity(volume["emptyDir"]["sizeLimit"]) > settings.disk_cache_bytes
    assert [c.where for c in containers if volume_name in c.mounts.values()] == [server.where]


def test_shared_service_reads_s3_into_its_ram_cache(built: dict[str, list[dict[str, Any]]]) -> None:
    containers, pods = pod_containers(built["shared"], "shared")
    server = next(c for c in containers if c.is_server)
    settings = server_settings(server)
    assert settings.s3_buckets and settings.upstream is None
    assert settings.cache_bytes > 0, "the shared tier keeps what it read from S3 in RAM (WEIGHTSTREAM_CACHE_BYTES)"
    limit = quantity(server.spec["resources"]["limits"]["memory"])
    assert limit > settings.cache_bytes, "the RAM cache must fit in the container's memory limit"
    # S3 by web identity: a projected token for STS, named by AWS_WEB_IDENTITY_TOKEN_FILE.
    token = Path(server.env["AWS_WEB_IDENTITY_TOKEN_FILE"])
    volume = next(v for v in pods[server.where]["volumes"] if v["name"] == server.mounts[str(token.parent)])
    (source,) = volume["projected"]["sources"]
    assert source["serviceAccountToken"] == {
        "audience": "sts.amazonaws.com",
        "expirationSeconds": 86400,
        "path": token.name,
    }
    assert "AWS_ROLE_ARN" in server.env


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


@dataclass
class SidecarParts:
    """A copy of both overlays, to break: the sidecar's docs, the shared service's, the sidecar's pod and server."""

    docs: list[dict[str, Any]]
    shared: list[dict[str, Any]]
    pod: dict[str, Any]
    server: dict[str, Any]

    def config(self) -> dict[str, str]:
        """The sidecar server's ConfigMap data."""
        data: dict[str, str] = next(d for d in self.docs if d["kind"] == "ConfigMap")["data"]
        return data

    def shared_config(self) -> dict[str, str]:
        data: dict[str, str] = next(d for d in self.shared if d["kind"] == "ConfigMap")["data"]
        return data

    def volume(self, name: str) -> dict[str, Any]:
        volume: dict[str, Any] = next(v for v in self.pod["volumes"] if v["name"] == name)
        return volume

    def container(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = next(
            c for c in [*self.pod["initContainers"], *self.pod["containers"]] if c["name"] == name
        )
        return found


def sidecar_problems(built: dict[str, list[dict[str, Any]]], change: Any, *, with_shared: bool = True) -> list[str]:
    """The sidecar overlay's problems after change(SidecarParts), checked in a cluster with the shared overlay."""
    overlays = copy.deepcopy(built)
    deployment = next(d for d in overlays["sidecar"] if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    server = next(c for c in pod["initContainers"] if c["name"] == "weightstream")
    change(SidecarParts(overlays["sidecar"], overlays["shared"], pod, server))
    cluster = cluster_of(overlays if with_shared else {"sidecar": overlays["sidecar"]})
    return all_problems(overlays["sidecar"], "overlay sidecar", cluster)


def only(problems: list[str], *said: str) -> None:
    """problems is one problem, which says each of said."""
    assert len(problems) == 1, problems
    for part in said:
        assert part in problems[0], (part, problems)


def test_checker_rejects_a_sidecar_whose_readiness_follows_its_store(built: dict[str, list[dict[str, Any]]]) -> None:
    def http(parts: SidecarParts) -> None:
        parts.server["readinessProbe"] = {"httpGet": {"path": "/readyz", "port": "http"}}

    def grpc(parts: SidecarParts) -> None:
        parts.server["readinessProbe"] = {"grpc": {"port": 50051}}

    def alive(parts: SidecarParts) -> None:
        parts.server["readinessProbe"] = {"httpGet": {"path": "/healthz", "port": "http"}}

    for change in (http, grpc):
        only(sidecar_problems(built, change), "a native sidecar's readiness probe counts in its pod's readiness")
    assert sidecar_problems(built, alive) == []


def test_checker_rejects_s3_credentials_beside_an_upstream(built: dict[str, list[dict[str, Any]]]) -> None:
    def keys(parts: SidecarParts) -> None:
        parts.server["env"] = [
            {"name": name, "valueFrom": {"secretKeyRef": {"name": "s3", "key": name.lower()}}}
            for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        ]

    def web_identity(parts: SidecarParts) -> None:
        parts.pod["volumes"].append(
            {
                "name": "aws-token",
                "projected": {"sources": [{"serviceAccountToken": {"audience": "sts.amazonaws.com", "path": "token"}}]},
            }
        )
        parts.server["volumeMounts"].append(
            {"name": "aws-token", "mountPath": "/var/run/secrets/aws", "readOnly": True}
        )

    def irsa(parts: SidecarParts) -> None:
        account = next(d for d in parts.docs if d["kind"] == "ServiceAccount")
        account["metadata"]["annotations"] = {"eks.amazonaws.com/role-arn": "arn:aws:iam::111122223333:role/reader"}

    def s3_setting(parts: SidecarParts) -> None:
        parts.config()["WEIGHTSTREAM_S3_REGION"] = "us-east-1"

    for change, said in (
        (keys, "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"),
        (web_identity, "(the web-identity token of volume aws-token)"),
        (s3_setting, "(WEIGHTSTREAM_S3_REGION)"),
    ):
        only(sidecar_problems(built, change), "reads from its upstream", "and no bucket, yet carries S3", said)
    only(sidecar_problems(built, irsa), "its ServiceAccount/inference has eks.amazonaws.com/role-arn")

    # A server may serve a bucket of its own beside its upstream: then it needs the credentials.
    def own_bucket(parts: SidecarParts) -> None:
        keys(parts)
        parts.config()["WEIGHTSTREAM_S3_BUCKETS"] = "scratch"

    assert sidecar_problems(built, own_bucket) == []


def test_checker_rejects_a_disk_cache_off_its_volume(built: dict[str, list[dict[str, Any]]]) -> None:
    def elsewhere(parts: SidecarParts) -> None:
        parts.config()["WEIGHTSTREAM_DISK_CACHE"] = "/var/lib/weightstream"

    def read_only(parts: SidecarParts) -> None:
        next(m for m in parts.server["volumeMounts"] if m["name"] == "disk-cache")["readOnly"] = True

    def engine_too(parts: SidecarParts) -> None:
        parts.container("engine")["volumeMounts"].append({"name": "disk-cache", "mountPath": "/weights"})

    def memory(parts: SidecarParts) -> None:
        parts.volume("disk-cache")["emptyDir"]["medium"] = "Memory"

    def secret(parts: SidecarParts) -> None:
        parts.volume("disk-cache").pop("emptyDir")
        parts.volume("disk-cache")["secret"] = {"secretName": "weightstream-upstream-token"}

    only(sidecar_problems(built, elsewhere), "the disk cache /var/lib/weightstream (WEIGHTSTREAM_DISK_CACHE) is on no")
    only(sidecar_problems(built, read_only), "/var/cache/weightstream, which is mounted read-only")
    only(
        sidecar_problems(built, engine_too),
        "the disk cache's volume disk-cache is mounted writable in overlay sidecar: Deployment/inference containers "
        "engine too",
    )
    only(sidecar_problems(built, memory), "the disk cache's volume disk-cache is a Memory emptyDir")
    only(sidecar_problems(built, secret), "is a secret volume, which is read-only")

    # Read-only elsewhere in the pod is fine: only the server writes there.
    def engine_reads(parts: SidecarParts) -> None:
        parts.container("engine")["volumeMounts"].append(
            {"name": "disk-cache", "mountPath": "/weights", "readOnly": True}
        )

    assert sidecar_problems(built, engine_reads) == []


def test_checker_rejects_a_disk_cache_volume_below_its_bound(built: dict[str, list[dict[str, Any]]]) -> None:
    def small(parts: SidecarParts) -> None:
        parts.volume("disk-cache")["emptyDir"]["sizeLimit"] = "32Gi"

    def larger_bound(parts: SidecarParts) -> None:
        parts.config()["WEIGHTSTREAM_DISK_CACHE_BYTES"] = "100GiB"

    def unbounded(parts: SidecarParts) -> None:
        del parts.volume("disk-cache")["emptyDir"]["sizeLimit"]

    def default_bound(parts: SidecarParts) -> None:
        del parts.config()["WEIGHTSTREAM_DISK_CACHE_BYTES"]
        parts.volume("disk-cache")["emptyDir"]["sizeLimit"] = "60Gi"
        parts.server["resources"]["requests"]["ephemeral-storage"] = "61Gi"

    def unrequested(parts: SidecarParts) -> None:
        parts.server["resources"]["requests"]["ephemeral-storage"] = "10Gi"

    only(sidecar_problems(built, small), "has sizeLimit 32Gi, less than WEIGHTSTREAM_DISK_CACHE_BYTES (68719476736")
    only(
        sidecar_problems(built, larger_bound),
        "has sizeLimit 72Gi, less than WEIGHTSTREAM_DISK_CACHE_BYTES (107374182400",
    )
    only(sidecar_problems(built, unbounded), "is an emptyDir without a sizeLimit")
    # Without the variable the bound is the setting's default, 64GiB.
    only(
        sidecar_problems(built, default_bound),
        "has sizeLimit 60Gi, less than WEIGHTSTREAM_DISK_CACHE_BYTES (68719476736",
    )
    only(
        sidecar_problems(built, unrequested),
        "requests ephemeral-storage 10Gi, less than the disk cache's sizeLimit 72Gi",
    )


def test_checker_takes_the_documented_disk_cache_volumes(built: dict[str, list[dict[str, Any]]]) -> None:
    """The alternatives deploy/README.md names to keep the cache across pods, and one it warns against."""

    def host_path(kind: str) -> Any:
        def change(parts: SidecarParts) -> None:
            parts.volume("disk-cache").pop("emptyDir")
            parts.volume("disk-cache")["hostPath"] = {"path": "/var/lib/weightstream/disk-cache", "type": kind}

        return change

    def claim(parts: SidecarParts) -> None:
        parts.volume("disk-cache").pop("emptyDir")
        parts.volume("disk-cache")["persistentVolumeClaim"] = {"claimName": "weightstream-disk-cache"}

    for change in (host_path("Directory"), claim):
        problems = sidecar_problems(built, change)
        assert problems == [], problems
    only(
        sidecar_problems(built, host_path("DirectoryOrCreate")),
        "is a hostPath of type DirectoryOrCreate, not Directory",
    )


def test_checker_rejects_an_upstream_the_cluster_does_not_serve(built: dict[str, list[dict[str, Any]]]) -> None:
    def upstream(target: str) -> Any:
        def change(parts: SidecarParts) -> None:
            parts.config()["WEIGHTSTREAM_UPSTREAM"] = target

        return change

    full = "weightstream-headless.weightstream.svc.cluster.local"
    for target, said in (
        (
            "dns:///weightstream-headles.weightstream.svc.cluster.local:50051",
            "names Service weightstream/weightstream-headles, which no overlay has",
        ),
        (
            "dns:///weightstream-headless.inference.svc.cluster.local:50051",
            "names Service inference/weightstream-headless, which no",
        ),
        # A short name is looked up in the sidecar's own namespace.
        ("weightstream-headless:50051", "names Service inference/weightstream-headless, which no overlay has"),
        (
            "dns:///weightstream.weightstream.svc.cluster.local:50051",
            "names Service weightstream/weightstream, which is not headless",
        ),
        (
            f"dns:///{full}:50052",
            f"the upstream {full}:50052 leads to port 'data' of overlay shared: Deployment/weightstream containers "
            "weightstream, not its gRPC port 50051",
        ),
        (
            f"dns:///{full}:50053",
            "Service weightstream/weightstream-headless has no port 50053 (its ports: [50051, 50052])",
        ),
        (f"dns:///{full}", "names no port (gRPC would dial 443)"),
    ):
        only(sidecar_problems(built, upstream(target)), said)
    only(sidecar_problems(built, lambda _parts: None, with_shared=False), "which no overlay has")
    # The client takes several addresses only as IP literals; host names go in one dns:/// name.
    only(
        sidecar_problems(built, upstream("shared-0.example:50051,shared-1.example:50051")),
        "several targets must all be IPv4 or all IPv6 literals",
    )
    # Names outside the cluster and addresses are the operator's to vouch for.
    for target in ("weights.example.com:443", "10.0.0.7:50051,10.0.0.8:50051"):
        assert sidecar_problems(built, upstream(target)) == []


def test_checker_requires_the_upstreams_token_and_tls(built: dict[str, list[dict[str, Any]]]) -> None:
    tls = {
        "WEIGHTSTREAM_TLS_CERT": "/etc/weightstream/tls/tls.crt",
        "WEIGHTSTREAM_TLS_KEY": "/etc/weightstream/tls/tls.key",
    }

    def tokenless(parts: SidecarParts) -> None:
        del parts.config()["WEIGHTSTREAM_UPSTREAM_TOKEN_FILE"]

    def shared_tls(parts: SidecarParts) -> None:
        parts.shared_config().update(tls)

    def plaintext_upstream(parts: SidecarParts) -> None:
        parts.config()["WEIGHTSTREAM_UPSTREAM_TLS"] = "1"

    def shared_mutual(parts: SidecarParts) -> None:
        parts.shared_config().update(tls, WEIGHTSTREAM_TLS_CLIENT_CA="/etc/weightstream/tls/ca.crt")
        parts.config()["WEIGHTSTREAM_UPSTREAM_TLS"] = "1"

    def mutual(parts: SidecarParts) -> None:
        shared_mutual(parts)
        parts.config().update(
            WEIGHTSTREAM_UPSTREAM_CA_FILE="/etc/weightstream/upstream/ca.crt",
            WEIGHTSTREAM_UPSTREAM_CLIENT_CERT="/etc/weightstream/upstream/tls.crt",
            WEIGHTSTREAM_UPSTREAM_CLIENT_KEY="/etc/weightstream/upstream/tls.key",
        )

    def unmounted_ca(parts: SidecarParts) -> None:
        mutual(parts)
        parts.config()["WEIGHTSTREAM_UPSTREAM_CA_FILE"] = "/etc/ssl/weightstream/ca.crt"

    only(sidecar_problems(built, tokenless), "requires a bearer token (WEIGHTSTREAM_TOKEN_FILE)")
    only(sidecar_problems(built, shared_tls), "serves TLS; set WEIGHTSTREAM_UPSTREAM_TLS")
    only(sidecar_problems(built, plaintext_upstream), "WEIGHTSTREAM_UPSTREAM_TLS is on, but its upstream")
    only(sidecar_problems(built, shared_mutual), "requires a client certificate (mutual TLS)")
    assert sidecar_problems(built, mutual) == []
    only(
        sidecar_problems(built, unmounted_ca),
        "the upstream CA file /etc/ssl/weightstream/ca.crt is on no mounted volume",
    )


def test_checker_requires_network_policies_to_let_the_upstream_through(
    built: dict[str, list[dict[str, Any]]],
) -> None:
    """The sidecar's policy restricts ingress only; these add the egress and the shared service's ingress rules."""
    shared_namespace = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "weightstream"}}}
    shared_pods = {**shared_namespace, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "weightstream"}}}
    dns = {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}

    def policy(namespace: str, app: str, kind: str, rules: list[dict[str, Any]]) -> Any:
        document = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"{app}-{kind.lower()}", "namespace": namespace},
            "spec": {
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": app}},
                "policyTypes": [kind],
                kind.lower(): rules,
            },
        }
        kubernetes_validate.validate(document, KUBERNETES_VERSIONS[-1], strict=True)

        def add(parts: SidecarParts) -> None:
            (parts.docs if namespace == "inference" else parts.shared).append(document)

        return add

    def egress(*rules: dict[str, Any]) -> Any:
        return policy("inference", "inference", "Egress", list(rules))

    def ingress(*rules: dict[str, Any]) -> Any:
        return policy("weightstream", "weightstream", "Ingress", list(rules))

    grpc_to_shared = {"to": [shared_pods], "ports": [{"port": 50051, "protocol": "TCP"}]}
    only(
        sidecar_problems(built, egress(dns)),
        "NetworkPolicy/inference-egress keeps",
        "from the gRPC port 50051 of its upstream",
    )
    only(
        sidecar_problems(built, egress(grpc_to_shared)),
        "NetworkPolicy/inference-egress keeps",
        "from DNS (UDP port 53)",
    )
    elsewhere = {
        **grpc_to_shared,
        "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "other"}}}],
    }
    only(sidecar_problems(built, egress(dns, elsewhere)), "from the gRPC port 50051")
    assert sidecar_problems(built, egress(dns, grpc_to_shared)) == []
    assert sidecar_problems(built, egress(dns, {"to": [shared_namespace], "ports": [{"port": "grpc"}]})) == []

    engines = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "inference"}}}
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ports = [{"port": "grpc", "protocol": "TCP"}, {"port": "data", "protocol": "TCP"}]
    only(
        sidecar_problems(built, ingress({"from": [monitoring], "ports": ports})),
        "NetworkPolicy/weightstream-ingress keeps overlay sidecar: Deployment/inference initContainers weightstream "
        "off the gRPC port 50051 of its upstream",
    )
    assert sidecar_problems(built, ingress({"from": [engines], "ports": ports})) == []


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
    servers = {c.host: c for c in containers if c.is_server}
    assert list(servers) == ["shared", "sidecar"]
    for server in servers.values():
        assert server.probes, f"{server.where} needs a health check on /readyz or /healthz"
    shared, sidecar = (server_settings(servers[name]) for name in ("shared", "sidecar"))
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
    # The shared tier reads the bucket into its RAM cache; the sidecar reads from the shared tier into
    # its disk cache, with no model root, bucket or credentials of its own, once the shared tier is ready.
    assert shared.s3_buckets and shared.cache_bytes > 0 and shared.upstream is None
    assert sidecar.upstream == f"shared:{shared.grpc_port}"
    assert sidecar.model_root is None and sidecar.s3_buckets == ()
    assert not set(AWS_CREDENTIAL_ENV) & set(servers["sidecar"].env)
    assert sidecar.disk_cache is not None
    volume = servers["sidecar"].mounts[str(sidecar.disk_cache)]
    assert volume in document["volumes"], "the disk cache is a named volume, which outlives the container"
    assert services["sidecar"]["depends_on"]["shared"]["condition"] == "service_healthy"
    client = next(c for c in containers if c.where.endswith("demo-client"))
    assert client.argv is not None
    namespace = parse_cli(client.argv, client.where)
    host, _, port = namespace.target.rpartition(":")
    assert host == "sidecar" and int(port) == sidecar.grpc_port
    # No advertised host: the demo client dials its target's host (the service name) with the data port.
    assert sidecar.data_port and sidecar.data_advertise is None
    published = compose_published(services["sidecar"])
    assert {sidecar.grpc_port, sidecar.data_port, sidecar.http_port} <= {target for _, _, target in published}
    for name in servers:
        addresses = {host_ip for host_ip, _, _ in compose_published(services[name])}
        assert addresses == {"127.0.0.1"}, f"{name} publishes its ports on {addresses}, not loopback alone"
    assert namespace.model.removeprefix("s3://").split("/")[0] in shared.s3_buckets
    assert services["demo-client"]["depends_on"]["sidecar"]["condition"] == "service_healthy"


def compose_document() -> dict[str, Any]:
    document: dict[str, Any] = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env_example())
    return document


def test_compose_checker_rejects_a_misspelt_variable_and_a_wrong_port() -> None:
    document = compose_document()
    environment = document["services"]["shared"]["environment"]
    environment["WEIGHTSTREAM_S3_BUCKET"] = environment.pop("WEIGHTSTREAM_S3_BUCKETS")
    problems = problems_of(compose_containers(document))
    assert any("WEIGHTSTREAM_S3_BUCKET is not a setting" in p for p in problems), problems
    document = compose_document()
    document["services"]["sidecar"]["environment"]["WEIGHTSTREAM_HTTP_PORT"] = "8081"
    problems = problems_of(compose_containers(document))
    assert any("probes HTTP port 8080, the server's REST port is 8081" in p for p in problems), problems
    document = compose_document()
    document["services"]["sidecar"]["environment"]["WEIGHTSTREAM_DATA_PORT"] = "50053"
    problems = problems_of(compose_containers(document))
    assert any("the data port 50053 is not among the container's ports" in p for p in problems), problems


def test_compose_checker_rejects_a_broken_sidecar_tier() -> None:
    def problems_after(change: Any) -> list[str]:
        document = compose_document()
        change(document["services"])
        return problems_of(compose_containers(document))

    def sidecar_env(**values: str) -> Any:
        return lambda services: services["sidecar"]["environment"].update(values)

    def disk_cache_mounted(entry: Any) -> Any:
        def change(services: dict[str, Any]) -> None:
            volumes = services["sidecar"]["volumes"]
            volumes[:] = [entry if str(v).endswith(":/var/cache/weightstream") else v for v in volumes]

        return change

    def shared_mounts_it(services: dict[str, Any]) -> None:
        services["shared"]["volumes"].append("disk-cache:/srv/cache")

    def shared_wants_a_token(services: dict[str, Any]) -> None:
        services["shared"]["environment"]["WEIGHTSTREAM_TOKEN_FILE"] = "/run/secrets/tokens"

    for change, said in (
        (sidecar_env(WEIGHTSTREAM_UPSTREAM="sharde:50051"), "the upstream sharde names no service of the compose file"),
        (sidecar_env(WEIGHTSTREAM_UPSTREAM="minio:9000"), "names a service that does not run `weightstream serve`"),
        (sidecar_env(WEIGHTSTREAM_UPSTREAM="shared:50052"), "shared:50052 is not the gRPC port 50051 of"),
        (sidecar_env(WEIGHTSTREAM_UPSTREAM="shared"), "the upstream shared names no port"),
        (
            sidecar_env(WEIGHTSTREAM_DISK_CACHE="/var/lib/weightstream"),
            "/var/lib/weightstream (WEIGHTSTREAM_DISK_CACHE) is on no",
        ),
        (
            disk_cache_mounted("disk-cache:/var/cache/weightstream:ro"),
            "/var/cache/weightstream, which is mounted read-only",
        ),
        (
            disk_cache_mounted({"type": "tmpfs", "target": "/var/cache/weightstream"}),
            "the disk cache /var/cache/weightstream is on a tmpfs",
        ),
        (
            shared_mounts_it,
            "the disk cache's volume disk-cache is mounted writable in docker-compose service shared too",
        ),
        (
            sidecar_env(AWS_ACCESS_KEY_ID="weightstream", AWS_SECRET_ACCESS_KEY="secret"),
            "and no bucket, yet carries S3 settings or credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)",
        ),
        (
            shared_wants_a_token,
            "requires a bearer token (WEIGHTSTREAM_TOKEN_FILE); set WEIGHTSTREAM_UPSTREAM_TOKEN_FILE",
        ),
    ):
        problems = problems_after(change)
        assert len(problems) == 1 and said in problems[0], (said, problems)


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
def test_compose_tiers_run_against_a_real_s3_store(s3_store: S3Process, tmp_path: Path) -> None:
    """The compose stack's steps as real processes, on s3rver in place of MinIO (no Docker here).

    The upload job's script and the demo client's command line are run as the compose file gives
    them, and both tiers with the compose file's settings; only the addresses (minio:9000,
    shared:50051, sidecar:50051), the ports and the disk cache's directory are this machine's. The
    demo client loads twice from the sidecar: first through the shared tier (which reads the bucket)
    into the disk cache, then from the disk cache alone. Its tensors come over the sidecar's data port.
    """
    document = compose_document()
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

    servers = {c.host: c for c in compose_containers(document) if c.is_server}
    loopback = {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0}
    shared_settings = server_settings(servers["shared"]).model_copy(
        update={**loopback, "data_port": 0, "s3_endpoint": s3_store.endpoint, "model_root": tmp_path / "models"}
    )
    (tmp_path / "models").mkdir()
    (data_port,) = free_ports(1)
    with serving(shared_settings) as shared:
        sidecar_settings = server_settings(servers["sidecar"])
        assert sidecar_settings.upstream == "shared:50051" and sidecar_settings.disk_cache is not None
        sidecar_settings = sidecar_settings.model_copy(
            update={
                **loopback,
                "data_port": data_port,
                "upstream": f"127.0.0.1:{shared.port}",
                "disk_cache": tmp_path / "disk-cache",
            }
        )
        with serving(sidecar_settings) as sidecar:
            argv = [a.replace("sidecar:50051", f"127.0.0.1:{sidecar.port}") for a in services["demo-client"]["command"]]
            command = [sys.executable, "-m", "weightstream", *argv]
            first = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
            read_from_shared = sidecar.tiers.source_bytes_read
            second = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
            cache = sidecar.tiers.cache
            assert cache is not None
            snapshot = cache.snapshot()
            read_again = sidecar.tiers.source_bytes_read - read_from_shared
    state = llama_like_state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    for result in (first, second):
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"loaded s3://{bucket}/{model}" in result.stdout
        assert f"{len(state)} tensors, {total:,d} bytes" in result.stdout, result.stdout
        assert "over tcp" in result.stdout, result.stdout
    # The first load came from the shared tier (which read the bucket) into the disk cache; the second
    # from the disk cache alone.
    assert read_from_shared > total, read_from_shared
    assert snapshot.files >= 3 and snapshot.resident_bytes >= total, snapshot
    assert read_again == 0, f"the second load read {read_again} bytes from the shared tier again"
