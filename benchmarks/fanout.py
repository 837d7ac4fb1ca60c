"""Fleet fan-out: seconds from a publish returning to the last engine's update_into, and the origin's bytes.

Each node in its own network namespace behind a link limited to --rate each way (tests/support/netns.py):
node 0 the origin (upstream server and trainer), nodes 1..N a sidecar and an engine each. For each
size and N, the trainer publishes --runs revisions with every element changed; the table gives the
median seconds (and spread) until every engine's update_into returned, bit-exact (BLAKE3 digest),
the bytes the origin's link sent per revision in copies of the revision, and the CPU seconds all
processes used per revision.

    sudo PYTHONPATH=$PWD:$PWD/client:$PWD/service .venv/bin/python -m benchmarks.fanout --mib 64 256 --nodes 1 2 4 8

--modes star chain tree: each fleet without peers serving peers, then with them (`--peers`) in chains and
in a tree of degree 2 (`--fanout-degree 2` at the origin), side by side.

--changed F: each revision after the first changes a share F of the previous one's elements (--spread
elements: scattered over every block, so that blocks travel as deltas; blocks: whole 1 MiB blocks, so
that only those travel); the table then also gives the bytes each node's link received per revision
(the most of any node, in copies of the revision).
Needs root (network namespaces, tc).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import process_cpu_seconds
from tests.support import fleet, netns

# mode: (the origin's options, the sidecars' options). star: every sidecar pulls from the origin (no
# fan-out); chain: peers serve peers, each forwarding every block as it arrives; tree: each peer serves two.
MODES: dict[str, tuple[list[str], list[str]]] = {
    "star": ([], []),
    "chain": ([], ["--peers"]),
    "tree": (["--fanout-degree", "2"], ["--peers"]),
}


def _cpu_seconds(running: fleet.Cluster) -> dict[str, float]:
    """CPU seconds (user and system) the fleet's processes used so far: the origin's (server and trainer),
    the sidecars' and the engines' (each node starts its sidecar, then its engine)."""
    total = {"origin": 0.0, "sidecars": 0.0, "engines": 0.0}
    for n, node in enumerate(running.fleet.nodes):
        for i, process in enumerate(node.processes):
            role = "origin" if n == 0 else ("sidecars" if i == 0 else "engines")
            for pid in _tree(process.pid):
                with contextlib.suppress(OSError):
                    total[role] += process_cpu_seconds(pid)
    return total


def _tree(pid: int) -> list[int]:
    """pid and its descendants (nsenter runs the command as its child)."""
    found = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return found
    for child in children:
        found += _tree(int(child))
    return found


def measure(
    mib: int, nodes: int, mode: str, runs: int, rate: str, folder: Path, changed: float = 1.0, spread: str = "elements"
) -> dict[str, object]:
    origin_extra, sidecar_extra = MODES[mode]
    with fleet.cluster(
        folder,
        nodes,
        mib,
        rate=rate,
        origin_extra=origin_extra,
        sidecar_extra=sidecar_extra,
        changed=changed,
        spread=spread,
    ) as running:
        seconds: list[float] = []
        copies: list[float] = []
        received: list[list[float]] = []
        cpu: list[dict[str, float]] = []
        indexes = list(range(1, nodes + 1))
        for k in range(1, runs + 1):
            time.sleep(0.5)  # the previous revision's last messages drain
            sent = running.origin.tx_bytes()
            taken = [running.node(i).rx_bytes() for i in indexes]
            cpu_before = _cpu_seconds(running)
            revision, published = running.publish(k)
            records = running.wait_engines(revision, indexes)
            if not all(r["exact"] for r in records.values()):
                raise AssertionError(f"an engine does not hold revision {revision} bit for bit: {records}")
            seconds.append(max(float(r["done"]) for r in records.values()) - published)
            cpu_after = _cpu_seconds(running)
            cpu.append({role: cpu_after[role] - cpu_before[role] for role in cpu_after})
            time.sleep(0.3)
            copies.append((running.origin.tx_bytes() - sent) / (mib * 1024 * 1024))
            received.append(
                [
                    (running.node(i).rx_bytes() - before) / (mib * 1024 * 1024)
                    for i, before in zip(indexes, taken, strict=True)
                ]
            )
    return {
        "mib": mib,
        "nodes": nodes,
        "mode": mode,
        "seconds": statistics.median(seconds),
        "spread": max(seconds) - min(seconds),
        "copies": statistics.median(copies),
        # Per node, the median over the revisions of what its link received.
        "received": [statistics.median(r[n] for r in received) for n in range(nodes)],
        "cpu": statistics.median(sum(c.values()) for c in cpu),
        "cpu_roles": {role: statistics.median(c[role] for c in cpu) for role in cpu[0]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, nargs="+", default=[64])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["star", "chain"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rate", default="500mbit")
    parser.add_argument("--changed", type=float, default=1.0, help="the share of elements each revision changes")
    parser.add_argument("--spread", choices=["elements", "blocks"], default="elements")
    args = parser.parse_args()
    why = netns.available()
    if why is not None:
        sys.exit(f"fanout benchmark: {why}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ws-fanout-") as tmp:
        for mib in args.mib:
            for mode in args.modes:
                for nodes in args.nodes:
                    folder = Path(tmp) / f"{mib}-{mode}-{nodes}"
                    row = measure(mib, nodes, mode, args.runs, args.rate, folder, args.changed, args.spread)
                    rows.append(row)
                    received = " ".join(f"{r:.3f}" for r in row["received"])  # type: ignore[attr-defined]
                    print(
                        f"{mib:>5} MiB {mode:>5} N={nodes}: {row['seconds']:.2f} s (spread {row['spread']:.2f}), "
                        f"origin sent {row['copies']:.3f} copies, nodes received {received}, "
                        f"{row['cpu']:.1f} CPU-s {row['cpu_roles']}",
                        flush=True,
                    )
    what = (
        "every element changed" if args.changed >= 1.0 else f"{args.changed:g} of the elements changed ({args.spread})"
    )
    print(f"\nlinks {args.rate} each way; median of {args.runs} revisions, {what}\n")
    print(
        "| MiB | mode | N | seconds (spread) | vs N=1 | origin bytes (copies) | node link bytes, most (copies) "
        "| CPU-s per revision |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        one = next(
            r for r in rows if r["mib"] == row["mib"] and r["mode"] == row["mode"] and r["nodes"] == min(args.nodes)
        )
        ratio = float(row["seconds"]) / float(one["seconds"])  # type: ignore[arg-type]
        print(
            f"| {row['mib']} | {row['mode']} | {row['nodes']} | {row['seconds']:.2f} ({row['spread']:.2f}) | "
            f"{ratio:.2f}x | {row['copies']:.3f} | {max(row['received']):.3f} | {row['cpu']:.1f} |"  # type: ignore[type-var]
        )


if __name__ == "__main__":
    main()
