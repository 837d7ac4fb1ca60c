"""The Helm chart deploy/helm/weightstream: `helm lint --strict` and `helm template` through Helm's own Go
code (helm-python-sdk), the rendered manifests validated against Kubernetes' schemas and checked, like
the kustomize overlays, by tests/deploy/checks.py: every env var, flag, probe, port, volume and upstream
must be what the server accepts and needs.

The values sets are the chart's own ci/*-values.yaml (and values.yaml alone); the pairs that make one
cluster (a shared service and sidecars reading from it) are checked together.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from tests.deploy.checks import (
    CHART,
    CLIENT_SHM_ENV,
    KUBERNETES_VERSIONS,
    OPERATOR_KINDS,
    all_problems,
    chart_values,
    helm_lint,
    helm_template,
    matches,
    pod_containers,
    quantity,
    server_settings,
)
from weightstream_server.settings import ServerSettings, env_name

# Each values set: (release, namespace). The shared service's release is `weightstream` in namespace
# `weightstream`, the name the sidecars' upstream address gives.
RELEASES = {
    "default": ("weightstream", "weightstream"),
    "shared": ("weightstream", "weightstream"),
    "sidecar": ("inference", "inference"),
    "tls": ("weightstream", "weightstream"),
    "sidecar-tls": ("inference", "inference"),
}

# The values sets applied together to one cluster.
CLUSTERS = (("shared", "sidecar"), ("tls", "sidecar-tls"))

# The settings the chart sets itself, from its own sections (ports, auth, publish, tls, upstream,
# diskCache, sidecar.sharedMemory) or the pod (data_advertise); every other one is a key of `config`.
CHART_OWNED = {
    "host",
    "grpc_port",
    "http_port",
    "data_port",
    "data_advertise",
    "token_file",
    "publish_token_file",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "upstream",
    "upstream_token_file",
    "upstream_tls",
    "upstream_ca_file",
    "upstream_client_cert",
    "upstream_client_key",
    "disk_cache",
    "shm_dir",
}


def render(name: str, **overrides: Any) -> list[dict[str, Any]]:
    values = copy.deepcopy(chart_values(name))
    values.update(overrides)
    release, namespace = RELEASES[name]
    return helm_template(values, release, namespace)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    found = {p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml")}
    assert found == set(RELEASES) - {"default"}, f"a values set without its release here: {found}"
    return {name: render(name) for name in RELEASES}


def server_of(docs: list[dict[str, Any]], label: str) -> tuple[ServerSettings, Any, dict[str, Any]]:
    containers, pods = pod_containers(docs, label)
    (server,) = (c for c in containers if c.is_server)
    return server_settings(server), server, pods[server.where]


@pytest.mark.parametrize("name", list(RELEASES))
def test_chart_lints_clean(name: str) -> None:
    assert helm_lint(chart_values(name)) == []


def test_lint_finds_a_broken_template(tmp_path: Path) -> None:
    chart = tmp_path / "weightstream"
    shutil.copytree(CHART, chart)
    deployment = chart / "templates" / "deployment.yaml"
    deployment.write_text(deployment.read_text().replace("{{- end }}\n", "", 1))
    problems = helm_lint({}, chart)
    assert any("deployment.yaml" in p for p in problems), problems


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_rendered_manifests_are_valid_kubernetes(rendered: dict[str, list[dict[str, Any]]], version: str) -> None:
    for name, docs in rendered.items():
        for doc in docs:
            if doc["kind"] in OPERATOR_KINDS:
                assert doc["apiVersion"] == "monitoring.coreos.com/v1"
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"values {name}: {doc['kind']}/{doc['metadata']['name']} is not valid Kubernetes {version}: {exc}"
                )


def test_rendered_manifests_use_only_what_the_server_accepts(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for name, docs in rendered.items():
        cluster = next(({n: rendered[n] for n in pair} for pair in CLUSTERS if name in pair), {name: docs})
        assert all_problems(docs, name, cluster) == [], name
        assert sum(c.is_server for c in pod_containers(docs, name)[0]) == 1, name


def test_the_checker_sees_a_broken_rendering(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The checks above would fail a chart that gave the server what it refuses, or a sidecar no token."""
    docs = render("shared", config={**chart_values("shared")["config"], "cache_bytes": "lots"})
    assert any("WEIGHTSTREAM_CACHE_BYTES" in p for p in all_problems(docs, "shared")), all_problems(docs, "shared")
    sidecar = render("sidecar", upstream={**chart_values("sidecar")["upstream"], "token": ""})
    problems = all_problems(sidecar, "sidecar", {"shared": rendered["shared"], "sidecar": sidecar})
    assert any("WEIGHTSTREAM_UPSTREAM_TOKEN_FILE" in p for p in problems), problems


def test_every_other_server_option_is_a_config_value() -> None:
    config = yaml.safe_load((CHART / "values.yaml").read_text())["config"]
    assert set(config) == set(ServerSettings.model_fields) - CHART_OWNED
    # values.schema.json takes exactly these: a misspelt option fails at install, not at the server's start.
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["config"]
    assert set(schema["properties"]) == set(config) and schema["additionalProperties"] is False
    assert list(config) == [f for f in ServerSettings.model_fields if f in config], "config keys out of --help order"


def test_config_values_reach_the_server_as_given() -> None:
    """Every config key set at once (lists, byte counts with units, floats, booleans) parses to what was meant."""
    given: dict[str, Any] = {
        "model_root": "/models",
        "max_streams": 12,
        "max_streams_per_client": 4,
        "stall_timeout": 90.5,
        "read_ahead_bytes": "128MiB",
        "chunk_bytes": 8388608,
        "streamer_concurrency": 8,
        "streamer_chunk_bytes": "16MiB",
        "log_level": "DEBUG",
        "s3_buckets": ["models", "more-models"],
        "gcs_buckets": ["gmodels"],
        "azure_containers": ["amodels"],
        "s3_endpoint": "http://minio.storage:9000",
        "s3_region": "eu-west-1",
        "s3_path_style": True,
        "s3_ca_bundle": "/etc/ssl/minio.pem",
        "storage_timeout": 60,
        "s3_request_timeout_ms": 20000,
        "drain_seconds": 25,
        "cache_bytes": 68719476736,
        "keep_revisions": 3,
        "allow_publish": True,
        "publish_dir": "/published",
        "publish_s3_prefix": "s3://models/published",
        "publish_max_bytes": "8GiB",
        "publish_assembly_timeout": 45,
        "delta_cache_bytes": 0,
        "max_watches": 8,
        "watch_interval": 2.5,
        "preload": ["s3://models/a", "s3://models/b"],
        "peers": False,  # True needs --upstream, which the shared mode has not
        "peer_stall_seconds": 1.5,
        "peer_min_rate": "4MiB",
        "fanout": True,
        "fanout_roots": 2,
        "fanout_degree": 3,
        "disk_cache_bytes": "10GiB",
    }
    assert set(given) == set(yaml.safe_load((CHART / "values.yaml").read_text())["config"])
    docs = helm_template({"config": given}, "weightstream", "weightstream")
    settings, server, _ = server_of(docs, "config")
    expected = ServerSettings.load(
        {}, {env_name(k): ",".join(v) if isinstance(v, list) else str(v) for k, v in given.items()}
    )
    for key in given:
        assert getattr(settings, key) == getattr(expected, key), (key, server.env.get(env_name(key)))
    # Helm reads 68719476736 as a float; the server must not get 6.8719476736e+10.
    assert server.env["WEIGHTSTREAM_CACHE_BYTES"] == "68719476736"
    assert settings.drain_seconds == 25 and settings.stall_timeout == 90.5


def test_shared_mode_has_its_parts(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["shared"]
    kinds = [d["kind"] for d in docs]
    assert {"Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "Secret", "ServiceMonitor"} <= set(kinds)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] >= 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    services = [d for d in docs if d["kind"] == "Service"]
    assert sorted(s["metadata"]["name"] for s in services) == ["weightstream", "weightstream-headless"]
    for selecting in [*services, *(d for d in docs if d["kind"] == "PodDisruptionBudget")]:
        assert matches(
            {"matchLabels": selecting["spec"]["selector"].get("matchLabels", selecting["spec"]["selector"])}, labels
        )
    (monitor,) = (d for d in docs if d["kind"] == "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")
    # /metrics needs a reader token: Prometheus sends one of those the server takes.
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    credentials = endpoint["authorization"]["credentials"]
    assert endpoint["authorization"]["type"] == "Bearer"
    token = secrets[credentials["name"]]["stringData"][credentials["key"]]
    assert token in secrets["weightstream-tokens"]["stringData"]["tokens"].split()
    main = next(s for s in services if s["metadata"]["name"] == "weightstream")
    assert matches(monitor["spec"]["selector"], main["metadata"]["labels"]), "the ServiceMonitor selects no Service"
    assert "http" in {p["name"] for p in main["spec"]["ports"]}
    settings, server, pod = server_of(docs, "shared")
    assert settings.token_file is not None and settings.publish_token_file is not None
    assert quantity(server.spec["resources"]["limits"]["memory"]) > settings.cache_bytes
    assert pod["terminationGracePeriodSeconds"] == 5 + 30 + 15
    # Token rotation is a Secret edit the server picks up: it must not roll the pods.
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert list(annotations) == ["checksum/config"]


def test_default_values_make_a_working_shared_service(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["default"]
    assert not [d for d in docs if d["kind"] in OPERATOR_KINDS], "the monitor needs the operator's CRDs: off by default"
    settings, _, _ = server_of(docs, "default")
    assert settings.host == "0.0.0.0" and settings.token_file is None and settings.tls_cert is None


def test_sidecar_mode_is_native_and_shares_memory_with_the_engine(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["sidecar"]
    containers, pods = pod_containers(docs, "sidecar")
    settings, server, pod = server_of(docs, "sidecar")
    engine = next(c for c in containers if c.spec["name"] == "engine")
    assert server.spec.get("restartPolicy") == "Always" and "initContainers" in server.where
    assert pod["initContainers"][0]["name"] == "weightstream", "init containers after it may call it"
    assert "readinessProbe" not in server.spec
    assert settings.shm_dir is not None and engine.env[CLIENT_SHM_ENV] == str(settings.shm_dir)
    assert engine.mounts[str(settings.shm_dir)] == server.mounts[str(settings.shm_dir)]
    assert engine.env["WEIGHTSTREAM_TARGET"] == f"127.0.0.1:{settings.grpc_port}"
    assert settings.data_advertise is None and settings.model_root is None
    assert settings.upstream == "dns:///weightstream-headless.weightstream.svc.cluster.local:50051"
    # The token it sends is one the shared service takes.
    secrets = {d["metadata"]["name"]: d for docs_ in rendered.values() for d in docs_ if d["kind"] == "Secret"}
    assert settings.upstream_token_file is not None
    token = secrets["inference-weightstream-upstream-token"]["stringData"][settings.upstream_token_file.name]
    shared_tokens = secrets["weightstream-tokens"]["stringData"]["tokens"].split()
    assert token in shared_tokens
    # The disk cache: the server's own emptyDir, bounded above the cache's bound.
    assert settings.disk_cache is not None
    volume = next(v for v in pod["volumes"] if v["name"] == server.mounts[str(settings.disk_cache)])
    assert quantity(volume["emptyDir"]["sizeLimit"]) > settings.disk_cache_bytes
    (monitor,) = (d for d in docs if d["kind"] in OPERATOR_KINDS)
    assert monitor["kind"] == "PodMonitor" and monitor["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    assert not [d for d in docs if d["kind"] in ("Service", "PodDisruptionBudget")]
    # Other pods reach the engine's API and, for the scrape, the REST port; never gRPC or the data port.
    (policy,) = (d for d in docs if d["kind"] == "NetworkPolicy")
    opened = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert opened == {8000, settings.http_port}
    assert pods[server.where]["terminationGracePeriodSeconds"] > settings.drain_seconds + 30


def test_tls_mode_serves_mutual_tls_and_the_sidecar_meets_it(rendered: dict[str, list[dict[str, Any]]]) -> None:
    settings, server, pod = server_of(rendered["tls"], "tls")
    assert str(settings.tls_cert) == "/etc/weightstream/tls/tls.crt" and settings.tls_client_ca is not None
    (volume,) = (v for v in pod["volumes"] if v["name"] == server.mounts["/etc/weightstream/tls"])
    assert volume["secret"]["secretName"] == "weightstream-tls"
    # kubelet's gRPC probes speak no TLS: every probe is HTTP on the REST port.
    assert {kind: "httpGet" in probe for kind, probe in server.probes.items()} == dict.fromkeys(server.probes, True)
    sidecar, _, _ = server_of(rendered["sidecar-tls"], "sidecar-tls")
    assert (
        sidecar.upstream_tls
        and sidecar.upstream_ca_file
        and sidecar.upstream_client_cert
        and sidecar.upstream_client_key
    )


def test_chart_made_tls_secret_holds_the_given_pem() -> None:
    docs = helm_template(
        {"tls": {"enabled": True, "cert": "CERT PEM", "key": "KEY PEM", "clientAuth": True, "clientCA": "CA PEM"}},
        "weightstream",
        "weightstream",
    )
    (secret,) = (d for d in docs if d["kind"] == "Secret")
    assert secret["type"] == "kubernetes.io/tls" and set(secret["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    settings, _, _ = server_of(docs, "tls")
    assert settings.tls_client_ca is not None


@pytest.mark.parametrize(
    ("values", "said"),
    [
        ({"mode": "both"}, "value must be one of 'shared', 'sidecar'"),
        ({"config": {"cache_byte": "8GiB"}}, "additional properties 'cache_byte' not allowed"),
        ({"tls": {"enabled": True}}, "tls.enabled needs tls.existingSecret"),
        ({"ports": {"http": 0}}, "at '/ports/http': minimum"),
        ({"upstream": {"tls": {"enabled": True}}}, "upstream.tls.enabled needs upstream.address"),
        (
            {"auth": {"existingSecret": "tokens"}, "serviceMonitor": {"enabled": True}},
            "needs serviceMonitor.tokenSecret.name",
        ),
    ],
)
def test_template_refuses_values_it_cannot_render(values: dict[str, Any], said: str) -> None:
    with pytest.raises(helm_python.HelmError, match=said):
        helm_template(values, "weightstream", "weightstream")


def test_sidecar_mode_alone_is_sound() -> None:
    """`--set mode=sidecar` and nothing else: the chart's own engine beside a server of the image's model root."""
    assert helm_lint({"mode": "sidecar"}) == []
    docs = helm_template({"mode": "sidecar"}, "inference", "inference")
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)
    assert all_problems(docs, "sidecar") == []
    settings, _, _ = server_of(docs, "sidecar")
    assert settings.upstream is None and settings.shm_dir is not None
