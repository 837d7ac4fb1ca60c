"""The upstream's fan-out plan (revisions.fanout): chains, trees, refused peers, addresses seen, not named."""

from __future__ import annotations

from weightstream_server.revisions import fanout as fanout_module
from weightstream_server.revisions.fanout import Fanout, parse_peer, peer_address


def test_peers_form_chains_below_the_roots_in_the_order_they_joined() -> None:
    fanout = Fanout(roots=1, degree=1)
    peers = [fanout.join("m", f"198.18.0.{i}:1") for i in range(1, 5)]
    assert [fanout.parent("m", "r1", p) for p in peers] == ["", "198.18.0.1:1", "198.18.0.2:1", "198.18.0.3:1"]
    two = Fanout(roots=2, degree=1)
    peers = [two.join("m", f"198.18.0.{i}:1") for i in range(1, 5)]
    assert [two.parent("m", "r1", p) for p in peers] == ["", "", "198.18.0.1:1", "198.18.0.2:1"]


def test_a_tree_of_degree_two_gives_each_peer_two_children() -> None:
    fanout = Fanout(roots=1, degree=2)
    peers = [fanout.join("m", f"198.18.0.{i}:1") for i in range(1, 6)]
    parents = [fanout.parent("m", "r", p) for p in peers]
    assert parents == ["", "198.18.0.1:1", "198.18.0.1:1", "198.18.0.2:1", "198.18.0.2:1"]


def test_a_refused_peer_is_left_out_of_that_revisions_plans_only() -> None:
    fanout = Fanout()
    a, b, c = (fanout.join("m", f"198.18.0.{i}:1") for i in (1, 2, 3))
    assert fanout.refuse("m", "r1", "198.18.0.2:1", reporter="198.18.0.3")  # c, planned below b
    assert fanout.parent("m", "r1", c) == "198.18.0.1:1"  # b is skipped
    assert fanout.parent("m", "r2", c) == "198.18.0.2:1"  # another revision: b is planned again
    assert fanout.parent("m", "r1", a) == ""
    fanout.leave("m", a)
    assert fanout.parent("m", "r2", b) == ""  # a left: b is the root now
    assert fanout.peers("other") == []


def test_a_peers_address_is_the_ip_the_server_sees_and_the_port_it_names() -> None:
    assert peer_address("ipv4:198.18.0.7:40000", 50051) == "198.18.0.7:50051"
    assert peer_address("ipv6:[2001:db8::7]:40000", 7) == "[2001:db8::7]:7"
    for bad in ("unix:/tmp/x", "ipv4:evil.example:1", "", "ipv4:1.2.3.4"):
        assert peer_address(bad, 50051) is None
    assert peer_address("ipv4:198.18.0.7:1", 0) is None
    assert peer_address("ipv4:198.18.0.7:1", 70000) is None
    assert parse_peer("198.18.0.7:50051") == "198.18.0.7:50051"
    for bad in ("evil.example:80", "1.2.3.4", "1.2.3.4:999999", "[::1]", "x" * 300):
        assert parse_peer(bad) is None


def test_no_peer_is_planned_at_a_loopback_unspecified_link_local_or_multicast_address() -> None:
    for grpc_peer in (
        "ipv4:127.0.0.1:1",
        "ipv4:127.3.4.5:1",
        "ipv4:0.0.0.0:1",
        "ipv4:169.254.169.254:1",
        "ipv4:224.0.0.1:1",
        "ipv6:[::1]:1",
        "ipv6:[::]:1",
        "ipv6:[fe80::1]:1",
        "ipv6:[ff02::1]:1",
        "ipv6:[::ffff:127.0.0.1]:1",
        "ipv6:[::ffff:169.254.169.254]:1",
    ):
        assert peer_address(grpc_peer, 50051) is None, grpc_peer
    for bad in ("127.0.0.1:50051", "[::1]:50051", "169.254.169.254:80"):
        assert parse_peer(bad) is None, bad
    assert peer_address("ipv4:198.19.255.1:1", 50051) == "198.19.255.1:50051"  # the fleet tests' 198.18.0.0/15


def test_a_refusal_counts_only_from_the_puller_planned_directly_below_the_peer() -> None:
    fanout = Fanout()
    a, _b, c = (fanout.join("m", f"198.18.0.{i}:1") for i in (1, 2, 3))
    # Neither a reader elsewhere, nor the peer itself, nor one planned elsewhere in the chain.
    assert not fanout.refuse("m", "r1", "198.18.0.2:1", reporter="203.0.113.9")
    assert not fanout.refuse("m", "r1", "198.18.0.2:1", reporter="198.18.0.2")
    assert not fanout.refuse("m", "r1", "198.18.0.1:1", reporter="198.18.0.3")
    # Nor for a model without peers: nothing is stored for names a reader made up.
    assert not fanout.refuse("x" * 1_000_000, "r1", "198.18.0.2:1", reporter="198.18.0.3")
    assert fanout._refused == {}
    assert fanout.parent("m", "r1", c) == "198.18.0.2:1"
    assert fanout.refuse("m", "r1", "198.18.0.2:1", reporter="198.18.0.3")
    assert fanout.parent("m", "r1", c) == "198.18.0.1:1"
    assert fanout.parent("m", "r1", a) == ""


def test_refusals_are_bounded_over_all_models() -> None:
    fanout = Fanout()
    for i in range(fanout_module.MAX_REFUSED_MODELS + 10):
        model = f"m{i}"
        fanout.join(model, "198.18.0.1:1")
        fanout.join(model, "198.18.0.2:1")
        assert fanout.refuse(model, "r", "198.18.0.1:1", reporter="198.18.0.2")
    assert len(fanout._refused) == fanout_module.MAX_REFUSED_MODELS


def test_a_peer_that_joins_again_replaces_its_entry_and_is_never_its_own_parent() -> None:
    fanout = Fanout()
    first = fanout.join("m", "198.18.0.1:1")
    fanout.join("m", "198.18.0.2:1")
    again = fanout.join("m", "198.18.0.1:1")  # a restarted sidecar, its old watch not yet ended
    assert fanout.peers("m") == ["198.18.0.1:1", "198.18.0.2:1"]
    assert fanout.parent("m", "r", again) == ""
    fanout.leave("m", first)  # the old watch ends: the new entry stays
    assert fanout.peers("m") == ["198.18.0.1:1", "198.18.0.2:1"]
