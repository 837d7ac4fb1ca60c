"""Fleet fan-out of a storage revision, end to end: a file rewritten at the origin reaches every node's disk cache.

An origin (`weightstream serve --model-root --fanout`) and three nodes, each a network namespace behind
a tbf-limited link (tests/support/netns.py) running a sidecar with --peers and a disk cache of its own;
the upstream plans them as one chain (the order their watches came). The model's file is rewritten
under the origin's root: every node's disk cache ends with the new file bit-exact, the origin's link
having sent about one copy of it, and the nodes below the first having taken it from a peer.
Needs root (ip netns, tc): skipped otherwise.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.support import fleet, netns
from tests.support.commands import weightstream_cmd

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(netns.available() is not None, reason=f"fleet tests: {netns.available()}"),
]

MODEL = "stored-model"
FILE = "model.safetensors"
MIB = 8
NODES = 3
WAIT_S = 60.0
PEER_BYTES = 'weightstream_fanout_bytes_received_total{source="peer"}'


def _write(root: Path, seed: int) -> bytes:
    """The model's file, replaced whole (a new storage revision); its bytes."""
    generator = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(MIB * 1024 * 1024 // 4, generator=generator), "b": torch.randn(7, generator=generator)}
    return fleet.rewrite(root / MODEL / FILE, state)


def test_a_storage_revision_reaches_every_nodes_disk_cache_bit_exact_with_the_origin_sending_about_one_copy(
    tmp_path: Path,
) -> None:
    root = tmp_path / "origin-root"
    (root / MODEL).mkdir(parents=True)
    first = _write(root, 0)
    env = fleet._env()
    with netns.Fleet(NODES + 1, rate="400mbit") as nodes:
        cluster = fleet.Cluster(nodes, tmp_path, NODES)
        origin = cluster.origin
        fleet.start_root_origin(cluster, root, 0.3)
        ask = [{"target": f"127.0.0.1:{fleet.GRPC_PORT}", "rpc": "manifest", "model": MODEL, "as": "plaintext"}]
        for i in range(1, NODES + 1):  # one by one: the upstream lists them in this order, one chain
            extra = ["--peers", "--peer-stall-seconds", "1", "--disk-cache", str(tmp_path / f"cache-{i}")]
            cluster.node(i).start(
                [*weightstream_cmd(), "serve", *fleet.sidecar_args(origin, extra)], tmp_path / f"sidecar-{i}.log", env
            )
            # The sidecar follows the model once asked for it, and takes its current revision.
            cluster.wait(lambda i=i: cluster.call(i, ask)[0]["code"] == "OK", f"node {i}'s sidecar serving", WAIT_S)
            cluster.wait(
                lambda i=i: fleet.disk_cache_holds(tmp_path / f"cache-{i}", first), f"node {i}'s first revision", WAIT_S
            )
        time.sleep(0.5)
        sent = origin.tx_bytes()
        received = [cluster.metrics(i).get(PEER_BYTES, 0) for i in (1, 2, 3)]
        second = _write(root, 1)
        for i in range(1, NODES + 1):
            cluster.wait(
                lambda i=i: fleet.disk_cache_holds(tmp_path / f"cache-{i}", second), f"node {i}'s new revision", WAIT_S
            )
        time.sleep(0.3)
        copies = (origin.tx_bytes() - sent) / len(second)
        from_peers = [cluster.metrics(i).get(PEER_BYTES, 0) - received[i - 1] for i in (1, 2, 3)]
    assert copies < 1.5, f"the origin sent {copies:.2f} copies of the file to {NODES} nodes"
    # Nodes 2 and 3 took the tensors from the node above them.
    assert sorted(from_peers)[1:] == [MIB * 1024 * 1024 + 28] * 2, from_peers
