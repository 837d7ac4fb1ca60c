"""Fleet fan-out, the upstream's side: who follows each model as a peer, and whom each takes a revision from.

A watch with a peer_port (a sidecar with --peers) is a peer of its model for as long as it lasts, at
the address the server sees it at (its IP, never a host it names: a watcher cannot point others at
an address of its choosing) and the port it names. The peers of a model, in the order their watches
came, form a tree: the first `roots` take a published revision from this server, and peer i after
them from peer (i - roots) // degree. With degree 1 (the default) that is `roots` chains: each peer
forwards every block as soon as it has it and checked it, so each link carries each byte about once
and a revision reaches the last peer of a chain about one link's transfer after the first.

A peer whose blocks failed their hashes at a puller (refuse) is left out of the plans of that
revision: the peers planned below it then take it from its parent.

Concurrency: every method may be called from any thread.
"""

from __future__ import annotations

import ipaddress
import itertools
import logging
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Revisions whose refused peers are remembered, per model.
MAX_REFUSED_REVISIONS = 8
# Peers remembered as refused per revision.
MAX_REFUSED_PEERS = 1024


@dataclass(frozen=True)
class Peer:
    key: int
    address: str  # "HOST:PORT", or "[V6]:PORT"


def peer_address(grpc_peer: str, port: int) -> str | None:
    """The address a watcher at grpc_peer (context.peer(): "ipv4:A.B.C.D:P", "ipv6:[..]:P") serves peers at."""
    if not 1 <= port <= 65535:
        return None
    kind, _, rest = grpc_peer.partition(":")
    host = rest.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if kind == "ipv4" and ip.version == 4:
        return f"{ip}:{port}"
    if kind == "ipv6":
        return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    return None


def parse_peer(address: str) -> str | None:
    """address as peer_address writes it ("IP:PORT", "[V6]:PORT"), or None if it is not one."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or len(port) > 5:
        return None
    try:
        ip = ipaddress.ip_address(host.strip("[]") if host.startswith("[") else host)
    except ValueError:
        return None
    return peer_address(f"ipv{ip.version}:{host}:0", int(port))


class Fanout:
    """The peers of each model and the plan of each revision."""

    def __init__(self, roots: int = 1, degree: int = 1) -> None:
        self.roots = roots
        self.degree = degree
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._peers: dict[str, list[Peer]] = {}
        # model -> revision -> addresses refused for it (bounded both ways).
        self._refused: dict[str, dict[str, set[str]]] = {}

    def join(self, model: str, address: str) -> Peer:
        peer = Peer(next(self._keys), address)
        with self._lock:
            self._peers.setdefault(model, []).append(peer)
        logger.info("model %r: peer %s joined the fan-out", model, address)
        return peer

    def leave(self, model: str, peer: Peer) -> None:
        with self._lock:
            peers = self._peers.get(model, [])
            if peer in peers:
                peers.remove(peer)
            if not peers:
                self._peers.pop(model, None)

    def refuse(self, model: str, revision: str, address: str) -> None:
        """Leave address out of revision's plans from now on (its blocks failed their hashes at a puller)."""
        with self._lock:
            revisions = self._refused.setdefault(model, {})
            refused = revisions.setdefault(revision, set())
            if len(refused) < MAX_REFUSED_PEERS:
                refused.add(address)
            while len(revisions) > MAX_REFUSED_REVISIONS:
                revisions.pop(next(iter(revisions)))
        logger.warning(
            "model %r: peer %s refused for revision %s: its blocks failed their hashes", model, address, revision
        )

    def parent(self, model: str, revision: str, peer: Peer) -> str:
        """The address peer takes revision from; "" for this server."""
        with self._lock:
            refused = self._refused.get(model, {}).get(revision, set())
            planned = [p for p in self._peers.get(model, []) if p.address not in refused or p is peer]
        if peer not in planned:
            return ""
        index = planned.index(peer)
        if index < self.roots:
            return ""
        parent = planned[(index - self.roots) // self.degree]
        return "" if parent.address in refused else parent.address

    def peers(self, model: str) -> list[str]:
        with self._lock:
            return [p.address for p in self._peers.get(model, [])]
