"""The upstream's fan-out plan (revisions.fanout): chains, trees, refused peers, addresses seen, not named."""

from __future__ import annotations

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
    fanout.refuse("m", "r1", "198.18.0.2:1")
    assert fanout.parent("m", "r1", c) == "198.18.0.1:1"  # b is skipped
    assert fanout.parent("m", "r2", c) == "198.18.0.2:1"  # another revision: b is planned again
    assert fanout.parent("m", "r1", a) == ""
    fanout.leave("m", a)
    assert fanout.parent("m", "r2", b) == ""  # a left: b is the root now
    assert fanout.peers("other") == []


def test_a_peers_address_is_the_ip_the_server_sees_and_the_port_it_names() -> None:
    assert peer_address("ipv4:198.18.0.7:40000", 50051) == "198.18.0.7:50051"
    assert peer_address("ipv6:[::1]:40000", 7) == "[::1]:7"
    for bad in ("unix:/tmp/x", "ipv4:evil.example:1", "", "ipv4:1.2.3.4"):
        assert peer_address(bad, 50051) is None
    assert peer_address("ipv4:198.18.0.7:1", 0) is None
    assert peer_address("ipv4:198.18.0.7:1", 70000) is None
    assert parse_peer("198.18.0.7:50051") == "198.18.0.7:50051"
    for bad in ("evil.example:80", "1.2.3.4", "1.2.3.4:999999", "[::1]", "x" * 300):
        assert parse_peer(bad) is None
