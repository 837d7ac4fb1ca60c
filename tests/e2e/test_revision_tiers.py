"""Revisions through a tier: a sidecar (--upstream, --disk-cache) follows its upstream's revisions.

Both tiers are real servers on 127.0.0.1 in this process, reading real files: a revision published
to the upstream reaches the sidecar's clients with only its changed bytes travelling between the
tiers (over the upstream's data port), a storage revision (files replaced under the upstream's root)
too, and while the sidecar follows a model its manifests cost the upstream no listing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.e2e.test_revisions import MODEL, assert_holds, changed, module_of, nbytes, served, state_of
from tests.support.ports import LOOPBACK, free_ports
from tests.support.servers import eventually, loopback_settings, serving
from weightstream.client import FailedPreconditionError, NotFoundError, WeightStreamClient
from weightstream_server import WeightStreamServer
from weightstream_server.ops.http import create_app, start_http
from weightstream_server.transports.tcp.servicer import FrameSender

# Two servers per test (an upstream and a sidecar with a disk cache) and waits for the sidecar to follow:
# about a second each, like the disk-cache delta tests.
pytestmark = pytest.mark.slow


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root" / MODEL).mkdir(parents=True)
    save_file(state_of(0), str(tmp_path / "root" / MODEL / "model.safetensors"))
    return tmp_path / "root"


@pytest.fixture
def upstream(root: Path) -> Iterator[WeightStreamServer]:
    (data_port,) = free_ports(1)
    settings = loopback_settings(model_root=root, allow_publish=True, watch_interval=0.2, data_port=data_port)
    with serving(settings) as server:
        yield server


@pytest.fixture
def sidecar(upstream: WeightStreamServer, tmp_path: Path) -> Iterator[WeightStreamServer]:
    settings = loopback_settings(
        upstream=f"{LOOPBACK}:{upstream.port}", disk_cache=tmp_path / "cache", watch_interval=0.2
    )
    with serving(settings) as server:
        yield server


def client_of(server: WeightStreamServer) -> WeightStreamClient:
    return WeightStreamClient(f"{LOOPBACK}:{server.port}", progress=False, transport="grpc")


def counted(monkeypatch: pytest.MonkeyPatch, server: WeightStreamServer) -> Callable[[], int]:
    """How many times the server's model root has been listed since (a ListModelFiles, a manifest)."""
    source = server.catalog.sources[0]
    calls = [0]
    resolve = source.resolve

    def counting(model: str) -> Any:
        calls[0] += 1
        return resolve(model)

    monkeypatch.setattr(source, "resolve", counting)
    return lambda: calls[0]


def test_a_revision_published_upstream_reaches_a_sidecars_clients_with_only_what_changed_between_tiers(
    upstream: WeightStreamServer, sidecar: WeightStreamServer
) -> None:
    a = state_of(0)
    names = ["layers.3.weight", "embed.weight"]
    b = changed(a, names, seed=1)
    module = module_of(a)
    with client_of(sidecar) as near, client_of(upstream) as far:
        since = near.load_into(module, MODEL).revision
        assert since == far.manifest(MODEL).revision  # a tier's revisions are its upstream's
        events = near.watch(MODEL)
        assert next(events).revision == since
        before = served(upstream)
        revision = far.publish(MODEL, b)
        event = next(events)
        events.close()
        between_tiers = served(upstream) - before
        assert (event.revision, event.origin) == (revision, "published")
        assert near.manifest(MODEL).revision == revision
        report = near.update_into(module, MODEL, since=since)
    assert_holds(module, b)
    assert report.revision == revision and report.bytes == nbytes(b, names)
    # What changed went between the tiers once; the rest was copied from the sidecar's disk cache.
    assert nbytes(b, names) <= between_tiers <= 1.1 * nbytes(b, names), between_tiers
    relay = sidecar.relay
    assert relay is not None and relay.counts.revisions == 1
    assert relay.counts.pulled_bytes == nbytes(b, names)
    assert relay.counts.copied_bytes == nbytes(a, list(a)) - nbytes(b, names)
    assert relay.transport == "tcp"  # the upstream's data port


def test_a_model_only_published_upstream_is_served_by_the_sidecar_and_a_second_revision_moves_only_its_changes(
    upstream: WeightStreamServer, sidecar: WeightStreamServer
) -> None:
    a = state_of(5)
    b = changed(a, ["head.weight"], seed=6)
    with client_of(sidecar) as near, client_of(upstream) as far:
        with pytest.raises(NotFoundError):
            near.manifest("trained")
        first = far.publish("trained", a)
        module = module_of(a)
        assert near.load_into(module, "trained").revision == first
        assert_holds(module, a)
        before = served(upstream)
        second = far.publish("trained", b)
        eventually(lambda: near.manifest("trained").revision == second, "the sidecar took the second revision")
        between_tiers = served(upstream) - before
        report = near.update_into(module, "trained", since=first)
    assert_holds(module, b)
    assert report.revision == second
    # From the revision the sidecar held in memory: only the changed tensor came from above, and
    # the unchanged ones are the same memory in both revisions it keeps.
    assert between_tiers == nbytes(b, ["head.weight"])
    relay, store = sidecar.relay, sidecar.revisions
    assert relay is not None and store is not None
    assert relay.counts.shared_bytes == nbytes(b, list(b)) - nbytes(b, ["head.weight"])
    assert store.held_bytes() <= nbytes(a, list(a)) + nbytes(b, ["head.weight"]) + 2 * 64, store.held_bytes()


def test_a_storage_revision_upstream_reaches_the_sidecar_whose_manifests_cost_the_upstream_no_listing(
    upstream: WeightStreamServer, sidecar: WeightStreamServer, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = state_of(0)
    module = module_of(a)
    listings = counted(monkeypatch, upstream)
    with client_of(sidecar) as near:
        since = near.load_into(module, MODEL).revision
        events = near.watch(MODEL)
        assert next(events).revision == since
        # The upstream's own watch of the model lists its files each --watch-interval (0.2 s); the
        # sidecar's 30 manifests in about a second add nothing to that.
        listed, started = listings(), time.monotonic()
        for _ in range(30):
            assert near.manifest(MODEL).revision == since
        polls = (time.monotonic() - started) / 0.2
        assert listings() - listed <= polls + 2, (listings() - listed, polls)
        b = changed(a, ["layers.5.weight"], seed=4)
        staged = root / MODEL / "model.safetensors.tmp"
        save_file(b, str(staged))
        staged.replace(root / MODEL / "model.safetensors")
        event = next(events)
        events.close()
        assert event.origin == "storage" and event.revision != since
        report = near.update_into(module, MODEL, since=since)
    assert_holds(module, b)
    assert report.revision == event.revision
    assert report.bytes == nbytes(b, ["layers.5.weight"])


def test_the_sidecars_status_shows_what_it_follows_and_relayed(
    upstream: WeightStreamServer, sidecar: WeightStreamServer
) -> None:
    a = state_of(0)
    with client_of(sidecar) as near, client_of(upstream) as far:
        near.manifest(MODEL)
        far.publish(MODEL, changed(a, ["head.weight"], seed=9))
        relay = sidecar.relay
        assert relay is not None
        eventually(lambda: relay.counts.revisions == 1, "the sidecar took the published revision")
    rest = start_http(create_app(sidecar), LOOPBACK, 0)
    try:
        with httpx.Client(trust_env=False) as http:
            body = http.get(f"http://{LOOPBACK}:{rest.port}/status", timeout=10.0).json()
    finally:
        rest.stop(5.0)
    shown = body["revisions"]["relay"]
    assert shown["followed"] == [MODEL]
    assert shown["revisions_total"] == 1
    # Its manifest started filling the disk cache: what was there by then was copied, the rest pulled.
    assert shown["pulled_bytes_total"] + shown["copied_bytes_total"] == nbytes(a, list(a))
    assert shown["pulled_bytes_total"] >= nbytes(a, ["head.weight"])
    assert shown["transport"] == "tcp"
    assert body["revisions"]["models"][MODEL]["origin"] == "published"


def test_a_sidecar_started_after_a_publish_serves_the_published_revision_and_relays_the_next_by_its_changes(
    upstream: WeightStreamServer, tmp_path: Path
) -> None:
    a = state_of(0)
    x = changed(a, list(a), seed=3)
    y = changed(x, ["head.weight"], seed=4)
    with client_of(upstream) as far:
        first = far.publish(MODEL, x)
        settings = loopback_settings(upstream=f"{LOOPBACK}:{upstream.port}", disk_cache=tmp_path / "late-cache")
        with serving(settings) as late, client_of(late) as near:
            module = module_of(a)
            # Not the upstream's files (an older storage revision): its current, published revision.
            assert near.load_into(module, MODEL).revision == first
            assert_holds(module, x)
            before = served(upstream)
            second = far.publish(MODEL, y)
            eventually(lambda: near.manifest(MODEL).revision == second, "the sidecar took the next revision")
            assert served(upstream) - before == nbytes(y, ["head.weight"])
            near.update_into(module, MODEL, since=first)
            assert_holds(module, y)


def test_file_bytes_between_the_tiers_travel_over_the_upstreams_data_port(
    upstream: WeightStreamServer, sidecar: WeightStreamServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[int] = []
    raw = FrameSender.raw

    def counting(self: FrameSender, name: bytes, offset: int, crc32c: int, data: bytes) -> None:
        sent.append(len(data))
        raw(self, name, offset, crc32c, data)

    monkeypatch.setattr(FrameSender, "raw", counting)
    a = state_of(0)
    module = module_of(a)
    with client_of(sidecar) as near:
        near.load_into(module, MODEL)  # the sidecar fills its disk cache from the upstream
    assert_holds(module, a)
    # The file read whole, header and tensors, as frames on the data port.
    file_size = sum(p.stat().st_size for p in Path(upstream.settings.model_root or "").rglob("*.safetensors"))
    assert sum(sent) == file_size, (sum(sent), file_size)


def test_a_revision_named_at_the_sidecar_a_moment_after_its_publish_upstream_is_waited_for(
    upstream: WeightStreamServer, sidecar: WeightStreamServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    relay = sidecar.relay
    assert relay is not None
    pull = relay._pull

    def slow_pull(model: str, revision: str, parent: str = "") -> None:
        time.sleep(1.0)  # the relay takes its time: the request naming the revision comes first
        pull(model, revision, parent)

    monkeypatch.setattr(relay, "_pull", slow_pull)
    b = changed(state_of(0), ["head.weight"], seed=12)
    with client_of(sidecar) as near, client_of(upstream) as far:
        near.manifest(MODEL)  # followed
        revision = far.publish(MODEL, b)
        assert near.manifest(MODEL, revision=revision).revision == revision
        started = time.monotonic()
        with pytest.raises(FailedPreconditionError, match="never-published"):
            near.manifest(MODEL, revision="never-published")
        assert time.monotonic() - started < 10, "a revision the upstream does not have is not waited for"


def test_a_sidecar_serves_the_deltas_it_pulled_from_its_upstream_without_computing_them(
    upstream: WeightStreamServer, sidecar: WeightStreamServer
) -> None:
    """A 2% step published upstream with deltas reaches the sidecar as those deltas (it holds the
    revision before in memory), and the sidecar keeps what it pulled: its own engine's update is
    served from them, bit-exact, with no delta computed at either tier."""
    from tests.e2e.test_deltas import module_of as bf16_module_of
    from tests.e2e.test_deltas import state_of as bf16_state_of
    from tests.e2e.test_deltas import stepped

    a = bf16_state_of(0)
    b = stepped(a, 0.02, seed=1)
    module = bf16_module_of(a)
    assert upstream.deltas is not None and sidecar.deltas is not None
    with client_of(sidecar) as near, client_of(upstream) as trainer:
        first = trainer.publish("stepped", a, deltas=True)
        assert near.load_into(module, "stepped").revision == first
        before = (upstream.deltas.snapshot(), sidecar.deltas.snapshot())
        second = trainer.publish("stepped", b, deltas=True)
        eventually(lambda: near.manifest("stepped").revision == second, "the sidecar took the second revision")
        report = near.update_into(module, "stepped", since=first)
        after = (upstream.deltas.snapshot(), sidecar.deltas.snapshot())
    assert_holds(module, b)
    assert report.delta_chunks > 0 and report.delta_fallbacks == 0
    assert report.delta_bytes < 0.1 * sum(t.numel() * t.element_size() for t in b.values())
    # Upstream: the relay's update was served from the publisher's deltas; sidecar: from the relay's.
    assert [x.computed for x in after] == [x.computed for x in before], (before, after)
    assert after[1].published > before[1].published
    assert after[1].reused - before[1].reused >= report.delta_chunks


def test_deltas_of_an_update_the_sidecar_abandoned_are_not_kept(
    upstream: WeightStreamServer, sidecar: WeightStreamServer
) -> None:
    """A hostile upstream answers the relay's update with deltas, then NOT_FOUND, then serves whole bytes
    that are not held^deltas (each chunk's CRC32C kept). The relay pulls the revision whole and must not
    keep those deltas: its engines updating from the revision held end with the bytes a full load gets.

    The upstream's lie is made in this process: the sidecar's client of it is wrapped, so that its
    update runs for real and then raises NOT_FOUND, and its load runs for real and then rewrites five
    bytes of one tensor's first chunk keeping that chunk's CRC32C (what the upstream would have sent)."""
    from tests.e2e.test_deltas import module_of as bf16_module_of
    from tests.e2e.test_deltas import state_of as bf16_state_of
    from tests.e2e.test_deltas import stepped
    from tests.support.forgery import crc32c, match_crc32c

    name = "embed.weight"
    relay = sidecar.relay
    assert relay is not None
    client = relay._client
    real_update, real_load = client.update_into, client.load_into

    def update_then_not_found(*args: Any, **kwargs: Any) -> Any:
        real_update(*args, **kwargs)
        raise NotFoundError("the upstream no longer keeps the revision held here")

    def load_other_bytes(views: Any, *args: Any, **kwargs: Any) -> Any:
        report = real_load(views, *args, **kwargs)
        if name in views:
            flat = views[name].view(-1).view(torch.uint8).numpy()
            want = crc32c(flat[: 4 << 20].copy())
            flat[1000] ^= 0x40
            match_crc32c(flat[: 4 << 20], want, 2000)
        return report

    a = bf16_state_of(0)
    b = stepped(a, 0.02, seed=1)
    module = bf16_module_of(a)
    with client_of(sidecar) as near, client_of(upstream) as trainer:
        first = trainer.publish("stepped", a, deltas=True)
        assert near.load_into(module, "stepped").revision == first
        client.update_into, client.load_into = update_then_not_found, load_other_bytes  # type: ignore[method-assign]
        second = trainer.publish("stepped", b, deltas=True)
        eventually(lambda: near.manifest("stepped").revision == second, "the sidecar took the second revision")
        near.update_into(module, "stepped", since=first)
        fresh = bf16_module_of(a)
        near.load_into(fresh, "stepped", revision=second)
    got, full = dict(module.named_parameters()), dict(fresh.named_parameters())
    assert all(torch.equal(got[n].view(torch.int16), full[n].view(torch.int16)) for n in got)
