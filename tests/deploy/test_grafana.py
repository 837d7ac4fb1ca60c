"""The Grafana dashboard deploy/grafana/weightstream.json: every metric its queries name is one real servers expose.

Two real servers on 127.0.0.1 in this process, as the Helm chart's two modes run them: a shared tier
(a model root, a RAM cache, publishing on) and a sidecar tier reading from it (--upstream, a disk
cache, a RAM cache, shared memory). A client loads a model through the sidecar, a trainer publishes a
new revision to the shared tier, the client updates to it in place (update_into), and asks for a model
that does not exist; then both servers' /metrics are read. Every metric name in every panel's PromQL
(and in the template variables' queries) must be a series one of them exposes, histogram _bucket,
_sum and _count series included, and every metric family they expose must be on some panel.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.support.checkpoints import skeleton, write_model
from tests.support.metrics import samples
from tests.support.ports import LOOPBACK
from tests.support.servers import eventually, loopback_settings, serving
from weightstream.client import NotFoundError, WeightStreamClient
from weightstream_server import WeightStreamServer
from weightstream_server.ops.http import create_app, start_http

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "weightstream.json"

MODEL = "dashboard"

# What Prometheus adds to a histogram's name for its series.
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers that are not functions, aggregations,
    keywords, label names (in matchers and grouping clauses), numbers or durations."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for found in _IDENTIFIER.finditer(text):
        before = text[found.start() - 1] if found.start() else " "
        if before.isdigit() or before in ".$":
            continue  # 1e3, 0.5, a $variable
        if text[found.end() :].lstrip().startswith("(") or found.group().lower() in _KEYWORDS:
            continue
        if found.group().lower() in ("inf", "nan"):
            continue
        names.add(found.group())
    return names


def test_metric_names_reads_promql() -> None:
    expr = (
        'sum by (code, instance) (rate(weightstream_errors_total{code=~"UN.*", job="a{b}"}[$__rate_interval])) '
        "/ on(instance) group_left(version) weightstream_info offset 5m * 1e3 "
        '+ histogram_quantile(0.9, sum without (x) (rate(weightstream_stream_duration_seconds_bucket{le!="+Inf"}[5m])))'
        " > bool 0.5 and absent(weightstream_active_streams) or vector(Inf)"
    )
    assert metric_names(expr) == {
        "weightstream_errors_total",
        "weightstream_info",
        "weightstream_stream_duration_seconds_bucket",
        "weightstream_active_streams",
    }


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels_of(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def queries(board: dict[str, Any]) -> dict[str, set[str]]:
    """Metric names by where they are named: each panel (by title) and each template variable."""
    named: dict[str, set[str]] = {}
    for panel in panels_of(board):
        for target in panel.get("targets", []):
            named.setdefault(f"panel {panel['title']!r}", set()).update(metric_names(target["expr"]))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            named[f"variable {variable['name']}"] = set(_LABEL_VALUES.findall(query))
    return named


def test_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["uid"] == "weightstream" and board["schemaVersion"] >= 36
    ids = [p["id"] for p in panels_of(board)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels_of(board):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel.get("description"), f"panel {panel['title']!r} says nothing of what it shows"
        for target in panel["targets"]:
            # Every series is of the servers chosen at the top.
            for selector in re.findall(r"weightstream_[a-z_]+\{([^}]*)\}", target["expr"]):
                assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector, target["expr"]
            for name in metric_names(target["expr"]):
                assert f"{name}{{" in target["expr"], (
                    f"{name} in {panel['title']!r} is not filtered by job and instance"
                )
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_every_metric_a_panel_names_is_on_metrics(tmp_path: Path) -> None:
    exposed = exposed_series(tmp_path)
    missing = {
        where: sorted(name for name in names if name not in exposed)
        for where, names in queries(dashboard()).items()
        if any(name not in exposed for name in names)
    }
    assert not missing, f"named by the dashboard but not on /metrics: {missing}"
    shown = set().union(*queries(dashboard()).values())
    shown_families = {_family(name) for name in shown}
    unshown = sorted({_family(name) for name in exposed} - shown_families)
    assert not unshown, f"metrics on /metrics that no panel shows: {unshown}"


def _family(series: str) -> str:
    for suffix in (*HISTOGRAM_SUFFIXES, "_total"):
        if series.endswith(suffix):
            return series.removesuffix(suffix)
    return series


def exposed_series(tmp_path: Path) -> set[str]:
    """Series names on the /metrics of a shared and a sidecar tier after a load, a publish, an update, an error."""
    root = tmp_path / "root"
    state = write_model(root, MODEL, tensors=4, numel=64 * 1024)
    changed = {name: tensor + 1 if name == "layer.1.weight" else tensor for name, tensor in state.items()}
    shared_settings = loopback_settings(model_root=root, allow_publish=True, cache_bytes=64 << 20, watch_interval=0.2)
    with (
        tempfile.TemporaryDirectory(prefix="weightstream-test-grafana-", dir="/dev/shm") as shm,
        serving(shared_settings) as shared,
        serving(
            loopback_settings(
                upstream=f"{LOOPBACK}:{shared.port}",
                disk_cache=tmp_path / "disk-cache",
                cache_bytes=64 << 20,
                shm_dir=Path(shm),
                watch_interval=0.2,
            )
        ) as sidecar,
    ):
        module = skeleton({name: (t.shape, t.dtype) for name, t in state.items()})
        with (
            WeightStreamClient(f"{LOOPBACK}:{sidecar.port}", progress=False, transport="shm", shm_dir=shm) as near,
            WeightStreamClient(f"{LOOPBACK}:{shared.port}", progress=False) as trainer,
        ):
            since = near.load_into(module, MODEL).revision
            revision = trainer.publish(MODEL, changed)
            eventually(lambda: near.manifest(MODEL).revision == revision, "the sidecar took the published revision")
            report = near.update_into(module, MODEL, since=since)
            with pytest.raises(NotFoundError):
                near.manifest("no-such-model")
        assert report.revision == revision
        got = dict(module.named_parameters())
        assert all(torch.equal(got[name], tensor) for name, tensor in changed.items())
        near_samples = _samples(sidecar)
        # The client's streams came over shared memory; the sidecar read the model from the shared tier.
        assert near_samples[("weightstream_transport_bytes_served_total", (("transport", "shm"),))] > 0
        assert near_samples[("weightstream_upstream_bytes_read_total", ())] > 0
        return {name for name, _ in near_samples} | {name for name, _ in _samples(shared)}


def _samples(server: WeightStreamServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    rest = start_http(create_app(server), LOOPBACK, 0)
    try:
        with httpx.Client(trust_env=False) as http:
            response = http.get(f"http://{LOOPBACK}:{rest.port}/metrics", timeout=10.0)
    finally:
        rest.stop(5.0)
    assert response.status_code == 200
    return samples(response.text)
