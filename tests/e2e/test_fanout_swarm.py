"""Fleet fan-out in a swarm (--fanout-shape swarm at the origin), in network namespaces.

Each node is a network namespace behind a tbf-limited link (tests/support/netns.py); node 0 is the
origin (upstream server and trainer), the others a sidecar and an engine each (tests/support/fleet.py).
The trainer's revision is three 4 MiB tensors: one group per node. Needs root (ip netns, tc): skipped
otherwise.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support import fleet, netns

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(netns.available() is not None, reason=f"fleet tests: {netns.available()}"),
]

PEERS = ["--peers", "--peer-stall-seconds", "2"]
PEER_BYTES = 'weightstream_fanout_bytes_received_total{source="peer"}'
UPSTREAM_BYTES = 'weightstream_fanout_bytes_received_total{source="upstream"}'


def test_a_swarm_of_three_ends_bit_exact_with_the_origin_sending_one_copy_and_each_node_two_thirds(
    tmp_path: Path,
) -> None:
    mib = 12
    size = mib << 20
    origin = ["--fanout-shape", "swarm"]
    with fleet.cluster(tmp_path, 3, mib, rate="400mbit", origin_extra=origin, sidecar_extra=PEERS) as running:
        time.sleep(0.5)
        nodes = [1, 2, 3]
        before = [running.metrics(i) for i in nodes]
        sent = running.origin.tx_bytes()
        revision, _ = running.publish(1)
        records = running.wait_engines(revision, nodes)
        assert all(r["exact"] for r in records.values()), records
        time.sleep(0.3)
        copies = (running.origin.tx_bytes() - sent) / size
        after = [running.metrics(i) for i in nodes]
    assert copies < 1.3, f"the origin sent {copies:.2f} copies of the revision to 3 nodes in a swarm"
    for i, (b, a) in zip(nodes, zip(before, after, strict=True), strict=True):
        from_peers = a.get(PEER_BYTES, 0) - b.get(PEER_BYTES, 0)
        from_upstream = a.get(UPSTREAM_BYTES, 0) - b.get(UPSTREAM_BYTES, 0)
        # Its own group (one tensor) from the origin, the two others from the two other nodes.
        assert (from_peers, from_upstream) == (2 * size // 3, size // 3), (i, from_peers, from_upstream)
