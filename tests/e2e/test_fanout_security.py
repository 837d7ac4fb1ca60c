"""Fleet fan-out with TLS and tokens, in network namespaces: peers reach each other as the tier does.

The origin and two sidecars run a secure fleet (tests/support/fleet.py, secure=True): gRPC over mutual
TLS with certificates made here (the servers' names every node's address), and one bearer token every
server accepts and every sidecar sends to its upstream and its peers. A published revision must reach
both engines bit-exact through a peer, and the peer RPCs must refuse what the other RPCs refuse: a
caller with no token or a wrong one (UNAUTHENTICATED), one without a client certificate and a
plaintext one (no TLS connection: UNAVAILABLE). A caller with the fleet's credentials
gets only blocks of a published revision a sidecar keeps, never a model it does not follow, a path,
or a file. Needs root (ip netns, tc): skipped otherwise.

tests/server/test_fanout_rpcs.py covers the same RPCs on loopback without TLS or tokens (which server
serves which, stream slots, made-up refusals), and tests/e2e/test_properties.py sends hostile model
ids and tensor names to an upstream's; these are the cases only a secure fleet shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import fleet, netns
from tests.support.checkpoints import write_model

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(netns.available() is not None, reason=f"fleet tests: {netns.available()}"),
]

PEERS = ["--peers", "--peer-stall-seconds", "1"]
MIB = 4  # one 4 MiB tensor: four blocks
TENSOR = "layers.0.weight"
# A model in the origin's model root that no sidecar follows (nothing publishes it).
UNFOLLOWED = "origin-only"
PEER_BYTES = 'weightstream_fanout_bytes_received_total{source="peer"}'


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[fleet.Cluster, dict[int, float]]]:
    """A secure fleet of two sidecars after revision 1 reached both engines, and what each node took from
    peers for it."""
    folder = tmp_path_factory.mktemp("fanout-security")
    write_model(folder / "origin-root", UNFOLLOWED, tensors=1, numel=1024, seed=3)
    with fleet.cluster(folder, 2, MIB, rate="400mbit", sidecar_extra=PEERS, secure=True) as running:
        before = {i: running.metrics(i).get(PEER_BYTES, 0.0) for i in (1, 2)}
        revision, _ = running.publish(1)
        records = running.wait_engines(revision, [1, 2])
        assert all(r["exact"] for r in records.values()), records
        yield running, {i: running.metrics(i).get(PEER_BYTES, 0.0) - before[i] for i in (1, 2)}


def _target(running: fleet.Cluster, index: int) -> str:
    return f"{running.node(index).address}:{fleet.GRPC_PORT}"


def test_over_tls_with_tokens_a_revision_reaches_both_nodes_through_a_peer(
    secure: tuple[fleet.Cluster, dict[int, float]],
) -> None:
    _, from_peers = secure
    # One sidecar takes the revision from the upstream, the other (planned below it) from that peer.
    assert max(from_peers.values()) >= MIB << 20, from_peers


def test_the_peer_rpcs_refuse_a_caller_without_the_token_a_client_certificate_or_tls(
    secure: tuple[fleet.Cluster, dict[int, float]],
) -> None:
    running, _ = secure
    revision = running.revisions[1]
    blocks: dict[str, Any] = {"rpc": "blocks", "model": fleet.MODEL, "revision": revision, "tensors": [TENSOR]}
    hashes: dict[str, Any] = {"rpc": "hashes", "model": fleet.MODEL, "revision": revision}
    shows = ["fleet", "no-token", "wrong-token", "no-cert", "plaintext"]
    requests = [
        *({**blocks, "target": _target(running, 1), "as": shown} for shown in shows),
        *({**hashes, "target": _target(running, 0), "as": shown} for shown in shows),
    ]
    # From node 2: where a peer of node 1 calls it from.
    answers = running.call(2, requests)
    codes = [answer["code"] for answer in answers]
    assert codes == ["OK", "UNAUTHENTICATED", "UNAUTHENTICATED", "UNAVAILABLE", "UNAVAILABLE"] * 2, answers
    assert answers[0]["bytes"] == MIB << 20 and answers[5]["messages"] == 1, answers
    assert all(answer["messages"] == 0 for answer in answers[1:5] + answers[6:]), answers


def test_a_peer_serves_no_model_it_does_not_follow_no_path_and_no_file(
    secure: tuple[fleet.Cluster, dict[int, float]],
) -> None:
    running, _ = secure
    revision = running.revisions[1]
    target = _target(running, 1)
    root = running.folder / "origin-root"
    cases = [
        (UNFOLLOWED, revision, TENSOR),
        (UNFOLLOWED, revision, "layer.0.weight"),
        ("..", revision, TENSOR),
        (f"../{fleet.MODEL}", revision, TENSOR),
        (str(root / UNFOLLOWED), revision, "layer.0.weight"),
        ("/etc", revision, "passwd"),
        (fleet.MODEL, revision, "model.safetensors"),
        (fleet.MODEL, revision, f"../{UNFOLLOWED}/model.safetensors"),
    ]
    requests = [
        {"rpc": "blocks", "model": model, "revision": name, "tensors": [tensor], "target": target, "as": "fleet"}
        for model, name, tensor in cases
    ]
    answers = running.call(2, requests)
    # Then the sidecar reads the unfollowed model through its upstream, and holds a (storage) revision of it.
    (read,) = running.call(2, [{"rpc": "manifest", "model": UNFOLLOWED, "target": target, "as": "fleet"}])
    assert read["code"] == "OK" and read["revision"], read
    cases.append((UNFOLLOWED, read["revision"], "layer.0.weight"))
    answers += running.call(2, [{**requests[0], "revision": read["revision"], "tensors": ["layer.0.weight"]}])
    refused = [a["code"] in ("NOT_FOUND", "INVALID_ARGUMENT") and a["messages"] == 0 for a in answers]
    assert all(refused), list(zip(cases, answers, strict=True))
