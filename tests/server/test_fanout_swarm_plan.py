"""The upstream's swarm plan (revisions.fanout, shape "swarm") and the puller's cut of a revision into
groups (revisions.peer_pull.swarm_groups)."""

from __future__ import annotations

import pytest
import torch

from weightstream.client.manifest import Manifest, TensorInfo
from weightstream_server.revisions.fanout import Fanout
from weightstream_server.revisions.peer_pull import swarm_groups


def _manifest(sizes: list[int]) -> Manifest:
    tensors = tuple(TensorInfo(f"t{i}", torch.uint8, (n,), n, f"{i}.safetensors") for i, n in enumerate(sizes))
    return Manifest("m", "r1", sum(sizes), tensors, (), {t.name: t for t in tensors})


def test_each_peer_takes_its_own_group_from_the_upstream_and_every_other_from_its_owner() -> None:
    fanout = Fanout(shape="swarm")
    a, b, c = (fanout.join("m", f"198.18.0.{i}:1") for i in (1, 2, 3))
    assert fanout.sources("m", "r1", a) == ["", "198.18.0.2:1", "198.18.0.3:1"]
    assert fanout.sources("m", "r1", b) == ["198.18.0.1:1", "", "198.18.0.3:1"]
    assert fanout.sources("m", "r1", c) == ["198.18.0.1:1", "198.18.0.2:1", ""]
    assert [fanout.parent("m", "r1", p) for p in (a, b, c)] == ["", "", ""]  # no tree in a swarm
    assert Fanout().sources("m", "r1", a) == []  # nor sources in a tree


def test_a_refused_owner_leaves_the_swarm_for_that_revision_and_counts_from_any_puller_of_its_group() -> None:
    fanout = Fanout(shape="swarm")
    a, _b, c = (fanout.join("m", f"198.18.0.{i}:1") for i in (1, 2, 3))
    assert not fanout.refuse("m", "r1", "198.18.0.2:1", reporter="203.0.113.9")  # not a peer
    assert not fanout.refuse("m", "r1", "198.18.0.2:1", reporter="198.18.0.2")  # the peer itself
    assert fanout.refuse("m", "r1", "198.18.0.2:1", reporter="198.18.0.1")  # a takes group 1 from b
    assert fanout.sources("m", "r1", a) == ["", "198.18.0.3:1"]
    assert fanout.sources("m", "r1", c) == ["198.18.0.1:1", ""]
    assert fanout.sources("m", "r2", c) == ["198.18.0.1:1", "198.18.0.2:1", ""]


def test_groups_are_contiguous_runs_of_about_equal_bytes_in_manifest_order() -> None:
    manifest = _manifest([10, 10, 10, 10, 40, 5, 5, 10])
    groups = swarm_groups(manifest, 3)
    assert [name for group in groups for name in group] == [t.name for t in manifest.tensors]
    assert groups == [["t0", "t1", "t2"], ["t3", "t4"], ["t5", "t6", "t7"]]
    assert swarm_groups(manifest, 1) == [[t.name for t in manifest.tensors]]
    # More groups than tensors: every tensor in exactly one group, some groups empty.
    many = swarm_groups(_manifest([1, 1]), 5)
    assert sorted(name for group in many for name in group) == ["t0", "t1"] and len(many) == 5


@pytest.mark.parametrize("count", [2, 4, 8])
def test_equal_tensors_are_cut_into_equal_groups(count: int) -> None:
    groups = swarm_groups(_manifest([1 << 20] * 16), count)
    assert [len(group) for group in groups] == [16 // count] * count
