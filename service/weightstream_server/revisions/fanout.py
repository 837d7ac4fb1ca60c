"""Fleet fan-out, the upstream's side: who follows each model as a peer, and whom each takes a revision from.

A watch with a peer_port (a sidecar with --peers) is a peer of its model for as long as it lasts, at
the address the server sees it at (its IP, never a host it names: a watcher cannot point others at
an address of its choosing) and the port it names. The peers of a model, in the order their watches
came, form a tree: the first `roots` take a published revision from this server, and peer i after
them from peer (i - roots) // degree. With degree 1 (the default) that is `roots` chains: each peer
forwards every block as soon as it has it and checked it, so each link carries each byte about once
and a revision reaches the last peer of a chain about one link's transfer after the first.

A peer whose blocks failed their hashes at a puller (refuse) is left out of the plans of that
revision: the peers planned below it then take it from its parent. A refusal is taken only from the
puller this server itself planned below that peer for that revision (its IP, as the server sees
it), and only for a model with peers: a reader cannot refuse an honest peer or fill memory.

A peer's address is never loopback, unspecified, link-local or multicast: a watcher cannot make the
others send their upstream token to a service on their own host.

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
# Models whose refused peers are remembered (only models with peers, whose watches are bounded too).
MAX_REFUSED_MODELS = 1024
# Characters of a model id or revision name written in a log line.
LOGGED_CHARS = 200


@dataclass(frozen=True)
class Peer:
    key: int
    address: str  # "HOST:PORT", or "[V6]:PORT"


def peer_address(grpc_peer: str, port: int) -> str | None:
    """The address a watcher at grpc_peer (context.peer(): "ipv4:A.B.C.D:P", "ipv6:[..]:P") serves peers at;
    None for an address other hosts' peers must not be sent to (loopback, unspecified, link-local, multicast)."""
    if not 1 <= port <= 65535:
        return None
    kind, _, rest = grpc_peer.partition(":")
    host = rest.rpartition(":")[0].strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_loopback or ip.is_unspecified or ip.is_link_local or ip.is_multicast:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        mapped = ip.ipv4_mapped
        if mapped.is_loopback or mapped.is_unspecified or mapped.is_link_local or mapped.is_multicast:
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
        """address joins model's peers, in place of an earlier watch at the same address (a restarted sidecar)."""
        peer = Peer(next(self._keys), address)
        with self._lock:
            peers = self._peers.setdefault(model, [])
            old = next((i for i, p in enumerate(peers) if p.address == address), None)
            if old is None:
                peers.append(peer)
            else:
                peers[old] = peer
        logger.info("model %r: peer %s joined the fan-out", model[:LOGGED_CHARS], address)
        return peer

    def leave(self, model: str, peer: Peer) -> None:
        with self._lock:
            peers = self._peers.get(model, [])
            if peer in peers:
                peers.remove(peer)
            if not peers:
                self._peers.pop(model, None)

    def refuse(self, model: str, revision: str, address: str, reporter: str) -> bool:
        """Leave address out of revision's plans from now on (its blocks failed their hashes at a puller),
        if reporter (the IP the report came from) is a peer this server planned directly below address
        for revision; False (nothing stored) otherwise."""
        with self._lock:
            peers = list(self._peers.get(model, []))
        below = [p for p in peers if _host(p.address) == reporter and p.address != address]
        if not any(self.parent(model, revision, p) == address for p in below):
            logger.info(
                "model %r: refusal of peer %s for revision %s from %s ignored: not a puller planned below it",
                model[:LOGGED_CHARS],
                address,
                revision[:LOGGED_CHARS],
                reporter,
            )
            return False
        with self._lock:
            if model not in self._refused and len(self._refused) >= MAX_REFUSED_MODELS:
                self._refused.pop(next(iter(self._refused)))
            revisions = self._refused.setdefault(model, {})
            refused = revisions.setdefault(revision, set())
            if len(refused) < MAX_REFUSED_PEERS:
                refused.add(address)
            while len(revisions) > MAX_REFUSED_REVISIONS:
                revisions.pop(next(iter(revisions)))
        logger.warning(
            "model %r: peer %s refused for revision %s: its blocks failed their hashes at %s",
            model[:LOGGED_CHARS],
            address,
            revision[:LOGGED_CHARS],
            reporter,
        )
        return True

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
        if parent.address in refused or parent.address == peer.address:
            return ""
        return parent.address

    def peers(self, model: str) -> list[str]:
        with self._lock:
            return [p.address for p in self._peers.get(model, [])]


def _host(address: str) -> str:
    """The IP of address as peer_address writes it ("IP:PORT", "[V6]:PORT")."""
    return address.rpartition(":")[0].strip("[]")


def reporter_host(grpc_peer: str) -> str:
    """The IP of a caller at grpc_peer (context.peer()), as _host gives it of a peer's address; "" if none."""
    kind, _, rest = grpc_peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    try:
        return str(ipaddress.ip_address(rest.rpartition(":")[0].strip("[]")))
    except ValueError:
        return ""
