"""A sidecar with --publish-dir in front of a lying upstream: what the upstream names is never a path.

A real upstream on 127.0.0.1 publishes revisions; a gRPC proxy of the test's own (LyingUpstream)
stands between it and the sidecar and renames what it reports (a revision called "../../escape" or
an absolute path, a watch event for another model), answering the sidecar's follow-up calls about
the lie with the real revision's bytes. The sidecar drops each lie (logged), writes nothing outside
its publish dir, and still relays an honest revision, written where it belongs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch
from google.protobuf.message import Message
from safetensors.torch import save_file

from tests.support.ports import LOOPBACK, free_ports
from tests.support.proxies import LyingUpstream, RewritingProxy
from tests.support.servers import eventually, loopback_settings, serving
from weightstream.client import WeightStreamClient
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server import WeightStreamServer

pytestmark = pytest.mark.slow

MODEL = "relayed"


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 9, generator=generator), "b": torch.randn(3, generator=generator)}


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[WeightStreamServer]:
    root = tmp_path / "root"
    (root / MODEL).mkdir(parents=True)
    save_file(state(0), str(root / MODEL / "model.safetensors"))
    (data_port,) = free_ports(1)
    settings = loopback_settings(model_root=root, allow_publish=True, watch_interval=0.2, data_port=data_port)
    with serving(settings) as server:
        yield server


def client_of(port: int) -> WeightStreamClient:
    return WeightStreamClient(f"{LOOPBACK}:{port}", progress=False, transport="grpc")


@pytest.mark.parametrize(
    "lie",
    [
        {"step-1": "../../escape"},
        {"step-1": "/tmp/weightstream-lying-upstream-absolute"},
        {"step-1": "x" * 10_000},
        {"step-1": "nul\0name"},
        {MODEL: "another-model"},
        {MODEL: "/tmp/weightstream-lying-upstream-model"},
    ],
    ids=["dot-dot", "absolute", "long", "nul", "other-model", "absolute-model"],
)
def test_a_sidecar_drops_what_a_lying_upstream_names_and_writes_only_inside_its_publish_dir(
    upstream: WeightStreamServer, tmp_path: Path, lie: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    publish_dir = tmp_path / "sidecar" / "published"
    with LyingUpstream(upstream.port, lie) as liar:
        settings = loopback_settings(
            upstream=liar.target, disk_cache=tmp_path / "cache", publish_dir=publish_dir, watch_interval=0.2
        )
        with serving(settings) as sidecar, client_of(upstream.port) as trainer, client_of(sidecar.port) as reader:
            reader.manifest(MODEL)  # the sidecar follows the model from now on
            with caplog.at_level(logging.WARNING, logger="weightstream_server.revisions.relay"):
                trainer.publish(MODEL, state(1), revision="step-1")
                eventually(
                    lambda: any("dropped" in r.getMessage() for r in caplog.records), "the lie dropped and logged"
                )
            if MODEL not in lie:
                # An honest revision after the lie is relayed and written where it belongs.
                trainer.publish(MODEL, state(2), revision="step-2")
                eventually(lambda: (publish_dir / MODEL / "step-2").is_dir(), "step-2 relayed into the publish dir")
                into = {name: torch.empty_like(t) for name, t in state(2).items()}
                reader.load_into(into, MODEL, revision="step-2")
                assert all(torch.equal(into[n], t) for n, t in state(2).items())
            assert reader.manifest(MODEL).revision != "step-1"  # the lie was never taken
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "escape" in p.name)
    assert written == [], written
    assert not Path("/tmp/weightstream-lying-upstream-absolute").exists()
    assert not Path("/tmp/weightstream-lying-upstream-model").exists()
    if MODEL not in lie:
        assert sorted(p.name for p in publish_dir.iterdir()) == [MODEL]
        assert sorted(p.name for p in (publish_dir / MODEL).iterdir() if p.is_dir()) == ["step-2"]
    else:
        assert not publish_dir.exists() or not any(publish_dir.iterdir())


class Replaying(RewritingProxy):
    """An upstream whose watch announces every revision in names before each real event (older ones it
    still keeps): a sidecar that took each announcement would pull them all."""

    def __init__(self, upstream_port: int, names: list[str]) -> None:
        super().__init__(upstream_port)
        self.names = names

    def answer(self, method: str, response: Message) -> Iterable[Message]:
        if method != "WatchModel":
            return (response,)
        assert isinstance(response, pb.WatchModelResponse)
        replayed = []
        for name in self.names:
            old = pb.WatchModelResponse()
            old.CopyFrom(response)
            old.revision = name
            replayed.append(old)
        return [*replayed, response]


def test_a_sidecar_takes_the_upstreams_current_revision_not_each_one_announced(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / MODEL).mkdir(parents=True)
    save_file(state(0), str(root / MODEL / "model.safetensors"))
    names = [f"burst-{step}" for step in range(8)]
    upstream_settings = loopback_settings(model_root=root, allow_publish=True, keep_revisions=10, watch_interval=0.2)
    with serving(upstream_settings) as upstream, client_of(upstream.port) as trainer:
        for step, name in enumerate(names):
            trainer.publish(MODEL, state(step), revision=name)
        with Replaying(upstream.port, names[:-1]) as replaying:
            settings = loopback_settings(upstream=replaying.target, disk_cache=tmp_path / "cache", watch_interval=0.2)
            with serving(settings) as sidecar, client_of(sidecar.port) as reader:
                eventually(lambda: reader.manifest(MODEL).revision == names[-1], "the current revision relayed")
                time.sleep(1.0)  # every announcement handled
                assert sidecar.relay is not None
                assert sidecar.relay.counts.revisions == 1, sidecar.relay.counts
