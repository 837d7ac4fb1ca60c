"""Several server replicas behind one client channel: gRPC's own round_robin balancing and retries.

A client target may be one address ("host:port"), a gRPC name that resolves to many addresses
("dns:///weightstream-headless.ns.svc:50051", a Kubernetes headless Service), or several addresses
("10.0.0.1:50051,10.0.0.2:50051" or a list of them). Every channel gets the service config below:
round_robin spreads calls (each stream is one call) over every address the name resolves to, and
gRPC retries a call that failed with UNAVAILABLE before any response arrived, on another address.
A stream that breaks after data arrived is resumed by the client itself (session.py), which asks
for the missing bytes only.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Sequence

from weightstream.v1 import weightstream_pb2 as pb

_SERVICE = pb.DESCRIPTOR.services_by_name["WeightStreamService"].full_name

SERVICE_CONFIG = json.dumps(
    {
        "loadBalancingConfig": [{"round_robin": {}}],
        "methodConfig": [
            {
                "name": [{"service": _SERVICE}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ],
    }
)

CHANNEL_OPTIONS: list[tuple[str, str | int]] = [
    ("grpc.service_config", SERVICE_CONFIG),
    # The service config above is the client's own; a DNS TXT record must not replace it.
    ("grpc.service_config_disable_resolution", 1),
    ("grpc.enable_retries", 1),
]


def channel_target(target: str | Sequence[str]) -> str:
    """The gRPC target for one address, a resolver name (dns:///...), or several addresses (IP literals)."""
    addresses = [target] if isinstance(target, str) else list(target)
    if len(addresses) == 1:
        addresses = [a.strip() for a in addresses[0].split(",")]
    addresses = [a for a in addresses if a]
    if not addresses:
        raise ValueError("no server address given")
    if len(addresses) == 1:
        return addresses[0]
    if any("://" in a or a.startswith(("ipv4:", "ipv6:", "unix:")) for a in addresses):
        raise ValueError(f"several targets must be plain host:port addresses, not {addresses}")
    families = {_family(a) for a in addresses}
    if len(families) != 1 or None in families:
        raise ValueError(
            f"several targets must all be IPv4 or all IPv6 literals ({addresses}); for host names use one "
            "dns:///name:port target that resolves to every replica (a Kubernetes headless Service)"
        )
    return f"{families.pop()}:" + ",".join(addresses)


def _family(address: str) -> str | None:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return "ipv4" if ipaddress.ip_address(host).version == 4 else "ipv6"
    except ValueError:
        return None


def target_host(channel: str) -> str:
    """The host of a channel target (the first address of several), as a tcp stream dials it; "" for unix sockets."""
    if channel.startswith("unix:"):
        return ""
    for scheme in ("ipv4:", "ipv6:"):
        if channel.startswith(scheme):
            channel = channel[len(scheme) :]
    if "://" in channel:
        channel = channel.split("://", 1)[1]
        channel = channel.split("/", 1)[1] if "/" in channel else channel
    first = channel.split(",", 1)[0]
    if first.startswith("["):
        return first[1:].split("]", 1)[0]
    if first.count(":") > 1:  # a bare IPv6 address without a port
        return first
    return first.rsplit(":", 1)[0] if ":" in first else first
