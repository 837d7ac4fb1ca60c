"""Fleet fan-out in network namespaces: sidecars with --peers take a published revision from each other.

Each node is a network namespace behind a tbf-limited link (tests/support/netns.py); node 0 is the
origin (upstream server and trainer), the others a sidecar and an engine each (tests/support/fleet.py).
Every engine must end bit-exact (the revision's BLAKE3 digest over the tensors it holds) whatever the
peers do: serve, die midway, or send wrong bytes. Needs root (ip netns, tc): skipped otherwise.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.support import fleet, netns

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(netns.available() is not None, reason=f"fleet tests: {netns.available()}"),
]

PEERS = ["--peers", "--peer-stall-seconds", "1"]


def _exact(records: dict[int, dict[str, object]]) -> None:
    assert all(r["exact"] for r in records.values()), records


def test_a_revision_reaches_every_node_bit_exact_with_the_origin_sending_about_one_copy(tmp_path: Path) -> None:
    mib = 8
    with fleet.cluster(tmp_path, 3, mib, rate="400mbit", sidecar_extra=PEERS) as running:
        time.sleep(0.5)
        sent = running.origin.tx_bytes()
        revision, _ = running.publish(1)
        _exact(running.wait_engines(revision, [1, 2, 3]))
        time.sleep(0.3)
        copies = (running.origin.tx_bytes() - sent) / (mib << 20)
        assert copies < 1.5, f"the origin sent {copies:.2f} copies of the revision to 3 nodes"
        from_peers = [
            running.metrics(i).get('weightstream_fanout_bytes_received_total{source="peer"}', 0) for i in (1, 2, 3)
        ]
        # Two of the three nodes took revisions 0 and 1 from a peer (which two: the order their watches came).
        assert sum(from_peers) >= 2 * 2 * (mib << 20), from_peers


def test_a_peer_killed_midway_leaves_the_nodes_below_it_bit_exact_from_the_upstream(tmp_path: Path) -> None:
    mib = 16
    with fleet.cluster(tmp_path, 3, mib, rate="100mbit", sidecar_extra=PEERS, one_by_one=True) as running:
        # The chain: origin -> node 1 -> node 2 -> node 3; node 2's sidecar dies while the revision flows.
        revision, _ = running.publish(1)
        time.sleep(0.6)  # about a third of the revision has passed each link
        running.node(2).processes[0].kill()
        _exact(running.wait_engines(revision, [1, 3], timeout=60))
        assert running.metrics(3)["weightstream_fanout_fallbacks_total"] >= 1


def test_a_hostile_peer_is_refused_and_its_pullers_end_bit_exact(tmp_path: Path) -> None:
    mib = 4
    with fleet.cluster(tmp_path, 3, mib, rate="400mbit", sidecar_extra=PEERS, start=[]) as running:
        hostile = [sys.executable, "-m", "tests.support.hostile_peer", "--model", fleet.MODEL]
        upstream = f"{running.origin.address}:{fleet.GRPC_PORT}"
        env = fleet._env()
        running.node(1).start(
            [*hostile, "--upstream", upstream, "--port", str(fleet.GRPC_PORT)], tmp_path / "hostile.log", env
        )
        time.sleep(2.0)  # its watch comes first: the upstream plans node 2 below it
        first = running.revisions[0]
        for i in (2, 3):  # one by one: node 2 is planned below the hostile peer, node 3 below node 2
            fleet.start_node(running, i, PEERS)
            _exact(running.wait_engines(first, [i]))
        revision, _ = running.publish(1)
        _exact(running.wait_engines(revision, [2, 3]))
        refused = running.metrics(2)["weightstream_fanout_blocks_refused_total"]
        assert refused >= 1
        assert running.node(1).address in (tmp_path / "sidecar-2.log").read_text()
