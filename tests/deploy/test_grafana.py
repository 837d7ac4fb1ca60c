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

import contextlib
import json
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.support.checkpoints import skeleton, write_model
from tests.support.metrics import samples
from tests.support.ports import LOOPBACK, free_ports
from tests.support.servers import eventually, loopback_settings, serving
from weightstream.client import NotFoundError, WeightStreamClient
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


@contextlib.contextmanager
def tiers_in_use(tmp_path: Path) -> Iterator[list[str]]:
    """A shared and a sidecar tier after a load, a publish, an update and an error; yields their REST addresses."""
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
        rests = [start_http(create_app(server), LOOPBACK, 0) for server in (shared, sidecar)]
        try:
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
            yield [f"{LOOPBACK}:{rest.port}" for rest in rests]
        finally:
            for rest in rests:
                rest.stop(5.0)


def exposed_series(tmp_path: Path) -> set[str]:
    """Series names on the /metrics of a shared and a sidecar tier in use."""
    with tiers_in_use(tmp_path) as (shared, sidecar), httpx.Client(trust_env=False) as http:
        found = [samples(http.get(f"http://{address}/metrics", timeout=10.0).text) for address in (shared, sidecar)]
    # The client's streams came over shared memory; the sidecar read the model from the shared tier.
    assert found[1][("weightstream_transport_bytes_served_total", (("transport", "shm"),))] > 0
    assert found[1][("weightstream_upstream_bytes_read_total", ())] > 0
    return {name for name, _ in found[0]} | {name for name, _ in found[1]}


# Values Grafana puts in place of its variables, for a query sent to Prometheus directly.
GRAFANA_VARIABLES = {"$__rate_interval": "5s", "$__range": "1m", "$job": ".*", "$instance": ".*"}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Prometheus: apt-get install prometheus")
def test_every_query_returns_data_from_a_real_prometheus(tmp_path: Path) -> None:
    """Prometheus scrapes both tiers every second; every panel's query and every variable's must parse and
    return series. Not part of `make test` (Prometheus comes from Debian's packages, not the project's
    installs): `make dashboard-test` installs it and runs this."""
    (port,) = free_ports(1)
    with tiers_in_use(tmp_path) as targets:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s}\nscrape_configs:\n  - job_name: weightstream\n"
            f"    static_configs: [{{targets: {json.dumps(targets)}}}]\n"
        )
        command = [
            str(shutil.which("prometheus")),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address={LOOPBACK}:{port}",
        ]
        with (
            open(tmp_path / "prometheus.log", "wb") as log,
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT) as prometheus,
            httpx.Client(trust_env=False, base_url=f"http://{LOOPBACK}:{port}") as http,
        ):
            try:

                def query(expr: str) -> httpx.Response:
                    for name, value in GRAFANA_VARIABLES.items():
                        expr = expr.replace(name, value)
                    return http.get("/api/v1/query", params={"query": expr}, timeout=10.0)

                # Two scrapes of each tier after its last change: every rate has two points.
                eventually(lambda: _scraped(query, 2), "two scrapes of both tiers", timeout=30.0)
                time.sleep(3.0)
                board = dashboard()
                exprs = [(p["title"], t["expr"]) for p in panels_of(board) for t in p.get("targets", [])]
                exprs += [
                    (v["name"], _LABEL_VALUES.search(v["query"]["query"]).group(1))  # type: ignore[union-attr]
                    for v in board["templating"]["list"]
                    if v["type"] == "query"
                ]
                failed = {}
                for title, expr in exprs:
                    response = query(expr)
                    if response.status_code != 200 or not response.json()["data"]["result"]:
                        failed[title] = (expr, response.text[:300])
                assert not failed, failed
            finally:
                prometheus.terminate()
                prometheus.wait(10)


def _scraped(query: Callable[[str], httpx.Response], scrapes: int) -> bool:
    """Whether Prometheus answers and has scraped both tiers at least scrapes times."""
    try:
        response = query(f"count_over_time(up[1m]) >= {scrapes}")
    except httpx.TransportError:
        return False  # not listening yet
    return response.status_code == 200 and len(response.json()["data"]["result"]) == 2
