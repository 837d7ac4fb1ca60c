"""Fleet fan-out of a storage revision: seconds from a file rewritten at the origin to every node's disk cache.

The origin serves a model root with --fanout; N nodes, each a network namespace behind a link limited to
--rate each way (tests/support/netns.py), run a sidecar with --peers and a disk cache of its own, one
chain in the order they joined. For each N, the model's one safetensors file (--mib, every element
new) is rewritten --runs times; the table gives the median seconds from the rewrite until every
node's disk cache kept the new file (bit for bit), the bytes the origin's link sent per revision in
copies of the file, and the most any node's link received.

    sudo PYTHONPATH=$PWD:$PWD/client:$PWD/service .venv/bin/python -m benchmarks.fanout_storage --mib 64 --nodes 1 4 8

Without --peers a sidecar reads a storage revision's files from its upstream when a client asks for
them, so the upstream's link carries one copy per node (a star): that path is not timed here.
Needs root (network namespaces, tc).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.support import fleet, netns
from tests.support.commands import weightstream_cmd

MODEL = "stored-model"
FILE = "model.safetensors"
WAIT_S = 300.0


def _write(root: Path, mib: int, seed: int) -> bytes:
    """The model's file, replaced whole (a new storage revision); its bytes."""
    generator = torch.Generator().manual_seed(seed)
    return fleet.rewrite(root / MODEL / FILE, {"w": torch.randn(mib * 1024 * 1024 // 4, generator=generator)})


def measure(mib: int, nodes: int, runs: int, rate: str, folder: Path) -> dict[str, object]:
    root = folder / "origin-root"
    (root / MODEL).mkdir(parents=True)
    current = _write(root, mib, 0)
    env = fleet._env()
    with netns.Fleet(nodes + 1, rate=rate) as running:
        cluster = fleet.Cluster(running, folder, nodes)
        origin = cluster.origin
        fleet.start_root_origin(cluster, root, 0.1)
        ask = [{"target": f"127.0.0.1:{fleet.GRPC_PORT}", "rpc": "manifest", "model": MODEL, "as": "plaintext"}]
        caches = [folder / f"cache-{i}" for i in range(1, nodes + 1)]
        for i in range(1, nodes + 1):  # one by one: the upstream lists them in this order, one chain
            extra = ["--peers", "--disk-cache", str(caches[i - 1])]
            cluster.node(i).start(
                [*weightstream_cmd(), "serve", *fleet.sidecar_args(origin, extra)], folder / f"sidecar-{i}.log", env
            )
            cluster.wait(lambda i=i: cluster.call(i, ask)[0]["code"] == "OK", f"node {i}'s sidecar serving", WAIT_S)
            cluster.wait(
                lambda i=i: fleet.disk_cache_holds(caches[i - 1], current), f"node {i}'s first revision", WAIT_S
            )
        seconds: list[float] = []
        copies: list[float] = []
        received: list[float] = []
        for k in range(1, runs + 1):
            time.sleep(0.5)
            sent = origin.tx_bytes()
            taken = [cluster.node(i).rx_bytes() for i in range(1, nodes + 1)]
            started = time.time()
            current = _write(root, mib, k)
            for cache in caches:
                cluster.wait(
                    lambda c=cache, b=current: fleet.disk_cache_holds(c, b), f"the new revision in {cache}", WAIT_S
                )
            seconds.append(time.time() - started)
            time.sleep(0.3)
            copies.append((origin.tx_bytes() - sent) / len(current))
            received.append(
                max((cluster.node(i).rx_bytes() - taken[i - 1]) / len(current) for i in range(1, nodes + 1))
            )
    return {
        "mib": mib,
        "nodes": nodes,
        "seconds": statistics.median(seconds),
        "spread": max(seconds) - min(seconds),
        "copies": statistics.median(copies),
        "received": statistics.median(received),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, nargs="+", default=[64])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", default="100mbit")
    args = parser.parse_args()
    why = netns.available()
    if why is not None:
        sys.exit(f"storage fan-out benchmark: {why}")
    print(f"links {args.rate} each way; median of {args.runs} rewrites, every element new; one chain\n")
    print("| MiB | N | seconds (spread) | vs N=1 | origin bytes (copies) | most a node received (copies) |")
    print("|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="ws-fanout-storage-") as tmp:
        for mib in args.mib:
            first: float | None = None
            for nodes in args.nodes:
                row = measure(mib, nodes, args.runs, args.rate, Path(tmp) / f"{mib}-{nodes}")
                seconds = float(row["seconds"])  # type: ignore[arg-type]
                first = seconds if first is None else first
                print(
                    f"| {mib} | {nodes} | {seconds:.2f} ({float(row['spread']):.2f}) | {seconds / first:.2f}x "  # type: ignore[arg-type]
                    f"| {float(row['copies']):.2f} | {float(row['received']):.2f} |",  # type: ignore[arg-type]
                    flush=True,
                )


if __name__ == "__main__":
    main()
