"""A fleet of nodes on one machine: one network namespace per node, each behind a rate-limited link.

Fleet() starts an anchor process in a fresh network namespace (`unshare -n`: no interface of the
host's is in it), puts a bridge there, and makes one named namespace per node (`ip netns add`, names
unique to this process) joined to the bridge by a veth pair whose two ends are limited with
`tc qdisc ... tbf` (the node's NIC, each way). Addresses come from 198.18.0.0/15 (reserved for
benchmarking) and exist only inside these namespaces, so nothing here can reach or change any
address of the host's.

Everything is bounded and removed on the way out, even on failure: every process started in a node
(Node.start) is killed by its id, every named namespace is deleted, and the anchor is killed, which
takes the bridge with it. Needs root (`ip netns`, `tc`), as the suite's fleet tests check first.

Concurrency: one thread drives a Fleet; processes started in nodes run on their own.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "198.18.0"
PREFIX_LEN = 24
BRIDGE = "wsbr0"
COMMAND_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0
_serial = itertools.count()


def available() -> str | None:
    """Why a fleet cannot be made here (not root, tools missing), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


def _run(command: Sequence[str]) -> str:
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass
class Node:
    """One node: a named namespace, its address, and the processes started in it."""

    name: str
    address: str
    interface: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """argv run inside this node's namespace."""
        return ["nsenter", f"--net=/run/netns/{self.name}", *argv]

    def run(self, argv: Sequence[str]) -> str:
        return _run(self.command(argv))

    def start(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start argv in this node, its output appended to log; killed when the fleet ends."""
        with log.open("ab") as sink:
            process = subprocess.Popen(
                self.command(argv), stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT, env=env
            )
        self.processes.append(process)
        return process

    def tx_bytes(self) -> int:
        """Bytes this node has sent on its link (its namespace's end of the veth pair)."""
        # Not /sys/class/net: sysfs shows the namespace of whoever mounted it, the host's.
        shown = json.loads(_run(["ip", "-n", self.name, "-s", "-j", "link", "show", "dev", self.interface]))
        return int(shown[0]["stats64"]["tx"]["bytes"])

    def rx_bytes(self) -> int:
        """Bytes this node has received on its link."""
        shown = json.loads(_run(["ip", "-n", self.name, "-s", "-j", "link", "show", "dev", self.interface]))
        return int(shown[0]["stats64"]["rx"]["bytes"])

    def cut(self) -> None:
        """Take the node's link down: nothing reaches it or leaves it."""
        self.run(["ip", "link", "set", self.interface, "down"])

    def mend(self) -> None:
        """Bring the node's link back up after cut()."""
        self.run(["ip", "link", "set", self.interface, "up"])

    def stop(self) -> None:
        for process in self.processes:
            _kill(process)
        self.processes.clear()


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_TIMEOUT_S)


class Fleet:
    """Nodes on a bridge in a namespace of their own, each link limited to rate (tc's syntax: 500mbit)."""

    def __init__(self, count: int, rate: str = "500mbit", burst: str = "512kb", latency: str = "100ms") -> None:
        if not 1 <= count <= 200:
            raise ValueError(f"a fleet has 1 to 200 nodes, not {count}")
        self.count = count
        self.rate, self.burst, self.latency = rate, burst, latency
        self.tag = f"wsf{os.getpid()}x{next(_serial)}"
        self.nodes: list[Node] = []
        self._anchor: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Fleet:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _anchor_cmd(self, argv: Sequence[str]) -> list[str]:
        assert self._anchor is not None
        return ["nsenter", f"--net=/proc/{self._anchor.pid}/ns/net", *argv]

    def _build(self) -> None:
        # The anchor holds the bridge's namespace for as long as the fleet lives; it dies with us
        # only if killed (close does), so it sleeps a bounded time.
        self._anchor = subprocess.Popen(["unshare", "-n", "sleep", "3600"], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        own = os.readlink("/proc/self/ns/net")
        while os.readlink(f"/proc/{self._anchor.pid}/ns/net") == own:  # unshare has not run yet
            if self._anchor.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("unshare -n did not start")
            time.sleep(0.01)
        anchor = self._anchor_cmd
        _run(anchor(["ip", "link", "set", "lo", "up"]))
        _run(anchor(["ip", "link", "add", BRIDGE, "type", "bridge"]))
        _run(anchor(["ip", "link", "set", BRIDGE, "up"]))
        for index in range(self.count):
            name = f"{self.tag}n{index}"
            outer, inner = f"ws{index}o", f"ws{index}i"
            address = f"{SUBNET}.{index + 1}"
            node = Node(name, address, "eth0")
            _run(["ip", "netns", "add", name])
            self.nodes.append(node)  # from here on, close deletes it
            _run(anchor(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner]))
            _run(anchor(["ip", "link", "set", inner, "netns", f"/run/netns/{name}"]))
            _run(anchor(["ip", "link", "set", outer, "master", BRIDGE, "up"]))
            node.run(["ip", "link", "set", inner, "name", "eth0"])
            node.run(["ip", "link", "set", "lo", "up"])
            node.run(["ip", "addr", "add", f"{address}/{PREFIX_LEN}", "dev", "eth0"])
            node.run(["ip", "link", "set", "eth0", "up"])
            tbf = ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
            node.run(["tc", "qdisc", "add", "dev", "eth0", *tbf])
            _run(anchor(["tc", "qdisc", "add", "dev", outer, *tbf]))

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        for node in self.nodes:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _run(["ip", "netns", "delete", node.name])
        self.nodes.clear()
        if self._anchor is not None:
            _kill(self._anchor)
            self._anchor = None

    def limit_path(self, index: int, to: int, rate: str | None) -> None:
        """Limit what node index sends to node `to` to rate (tc's syntax) from now on, all else it sends
        as before; None: back to one limit on all it sends."""
        node, dev = self.nodes[index], ["dev", self.nodes[index].interface]
        own = ["tbf", "rate", self.rate, "burst", self.burst, "latency", self.latency]
        if rate is None:
            node.run(["tc", "qdisc", "replace", *dev, "root", *own])
            return
        # Two classes: everything in the first (the node's own limit) but what the filter puts in the second.
        node.run(["tc", "qdisc", "replace", *dev, "root", "handle", "1:", "htb", "default", "10"])
        node.run(["tc", "class", "add", *dev, "parent", "1:", "classid", "1:10", "htb", "rate", self.rate])
        node.run(["tc", "class", "add", *dev, "parent", "1:", "classid", "1:20", "htb", "rate", rate])
        target = f"{self.nodes[to].address}/32"
        node.run(["tc", "filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
                  "dst", target, "flowid", "1:20"])  # fmt: skip

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)
