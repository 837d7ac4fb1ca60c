"""A revision's digest: BLAKE3 over its tensors' block hashes, served with the manifest and in /status,
and computed by a client from the bytes it holds.

A real server on 127.0.0.1 in this process: a published revision, a storage revision once its files
are digested (GetChanges digests them) and a relayed revision each carry a digest that a client
recomputes from what it loaded; one flipped byte, or bytes forged to keep every chunk's CRC32C,
give another digest.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.support.forgery import crc32c, match_crc32c
from tests.support.ports import LOOPBACK
from tests.support.servers import eventually, loopback_settings, running, serving
from weightstream.client import WeightStreamClient
from weightstream.protocol import digests, wire

MODEL = "digested"


def state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(600_000, generator=generator),  # 2.4 MB: three blocks
        "norm": torch.randn(100, generator=generator).to(torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int64),
    }


def loaded(client: WeightStreamClient, revision: str = "") -> dict[str, torch.Tensor]:
    into = {name: torch.empty_like(t) for name, t in state(0).items()}
    client.load_into(into, MODEL, revision=revision)
    return into


def test_a_published_revision_has_a_digest_a_client_recomputes_from_what_it_holds(tmp_path: Path) -> None:
    with (
        running(tmp_path, allow_publish=True) as r,
        WeightStreamClient(f"{LOOPBACK}:{r.server.port}", progress=False) as client,
    ):
        revision = client.publish(MODEL, state(1), revision="one", new_layout=True)
        manifest = client.manifest(MODEL)
        assert manifest.revision == revision
        assert manifest.digest.startswith(digests.PREFIX) and len(manifest.digest) == len(digests.PREFIX) + 64
        held = loaded(client)
        assert manifest.digest_of(held) == manifest.digest
        assert r.get("/status").json()["revisions"]["models"][MODEL]["digest"] == manifest.digest

        flipped = {name: t.clone() for name, t in held.items()}
        flipped["big"].view(torch.uint8)[1_500_000] ^= 1
        assert manifest.digest_of(flipped) != manifest.digest

        # Bytes that keep every chunk's CRC32C (two 4 KiB chunks swapped: each arrives with its own CRC)
        # are another revision all the same.
        swapped = {name: t.clone() for name, t in held.items()}
        raw = swapped["big"].view(torch.uint8)
        first, second = raw[:4096].clone(), raw[4096:8192].clone()
        raw[:4096], raw[4096:8192] = second, first
        crcs = sorted(wire.crc32c(bytes(raw[i : i + 4096].numpy())) for i in (0, 4096))
        assert crcs == sorted(wire.crc32c(bytes(c.numpy())) for c in (first, second))
        assert manifest.digest_of(swapped) != manifest.digest

        other = client.publish(MODEL, state(2), revision="two")
        assert client.manifest(MODEL, revision=other).digest != manifest.digest
        assert client.manifest(MODEL, revision=revision).digest == manifest.digest


@pytest.mark.parametrize("chunk_bytes", [wire.DEFAULT_CHUNK_BYTES, 1_500_000, 300_001])
def test_a_revision_published_with_deltas_in_chunks_that_cut_blocks_has_the_digest_of_its_bytes(
    tmp_path: Path, chunk_bytes: int
) -> None:
    """A publish's block checks are made as its chunks land, and taken from the delta base for the
    blocks no chunk touched: whatever the chunks' size and whichever blocks changed, the revision's
    digest is the one of its bytes, and the same as a whole publish of them gets."""
    a = state(0)
    b = {name: t.clone() for name, t in a.items()}
    b["big"][200_000:200_010] += 1.0  # inside the second block; the first and third stay the base's
    b["ids"][3] = 99
    with (
        running(tmp_path, allow_publish=True) as r,
        WeightStreamClient(f"{LOOPBACK}:{r.server.port}", progress=False, chunk_bytes=chunk_bytes) as client,
    ):
        client.publish(MODEL, a, revision="a", new_layout=True, deltas=True)
        revision = client.publish(MODEL, b, revision="b", deltas=True)
        assert client.last_publish is not None and client.last_publish.delta_base == "a"
        assert client.last_publish.sent_bytes < 1_000_000  # the changed chunks only
        client.publish("whole", b, revision="b", new_layout=True)
        manifest = client.manifest(MODEL, revision=revision)
        held = loaded(client, revision)
        assert all(torch.equal(held[name], b[name]) for name in b)
        assert manifest.digest == manifest.digest_of(b) == client.manifest("whole").digest
        changes = client.changes(MODEL, since="a", revision=revision)
        assert sorted(changes.tensors) == ["big", "ids"]


def test_a_block_forged_to_keep_its_crc32c_is_changed_and_an_update_gets_it(tmp_path: Path) -> None:
    """A publisher sends a block whose bytes differ from the held revision's but whose CRC32C is the
    same: GetChanges names it changed (the block BLAKE3 hashes differ), and an update lands it."""
    block = digests.DIGEST_BLOCK_BYTES
    a = state(0)
    b = {name: t.clone() for name, t in a.items()}
    raw = b["big"].view(torch.uint8).numpy()
    raw[100:200] ^= 0xFF
    match_crc32c(raw[:block], crc32c(a["big"].view(torch.uint8).numpy()[:block]), at=1000)
    assert not torch.equal(a["big"], b["big"])
    with (
        running(tmp_path, allow_publish=True) as r,
        WeightStreamClient(f"{LOOPBACK}:{r.server.port}", progress=False) as client,
    ):
        revision_a = client.publish(MODEL, a, revision="a", new_layout=True)
        held = loaded(client)
        client.publish(MODEL, b, revision="b")
        changes = client.changes(MODEL, since=revision_a)
        assert "big" in changes.tensors
        client.update_into(held, MODEL, since=revision_a, deltas=False)
        assert torch.equal(held["big"].view(torch.uint8), b["big"].view(torch.uint8))
        with_deltas = loaded(client, revision_a)
        client.update_into(with_deltas, MODEL, since=revision_a)
        assert torch.equal(with_deltas["big"].view(torch.uint8), b["big"].view(torch.uint8))


def test_a_storage_revision_is_digested_with_its_block_checksums_and_a_relay_keeps_the_digest(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    (root / MODEL).mkdir(parents=True)
    save_file(state(3), str(root / MODEL / "model.safetensors"))
    with serving(loopback_settings(model_root=root, allow_publish=True, watch_interval=0.2)) as upstream:
        with WeightStreamClient(f"{LOOPBACK}:{upstream.port}", progress=False) as client:
            first = client.manifest(MODEL)
            assert first.digest == ""  # not digested yet: no files read for it
            client.changes(MODEL, since=first.revision)  # digests the storage revision's files
            manifest = client.manifest(MODEL)
            assert manifest.digest.startswith(digests.PREFIX)
            assert manifest.digest_of(loaded(client)) == manifest.digest
            published = client.publish(MODEL, state(4), revision="pub")
            digest = client.manifest(MODEL, revision=published).digest
        sidecar_settings = loopback_settings(upstream=f"{LOOPBACK}:{upstream.port}", disk_cache=tmp_path / "cache")
        with serving(sidecar_settings) as sidecar:
            with WeightStreamClient(f"{LOOPBACK}:{sidecar.port}", progress=False) as client:
                eventually(lambda: client.manifest(MODEL).revision == published, "the published revision relayed")
                relayed = client.manifest(MODEL)
                assert relayed.digest == digest
                assert relayed.digest_of(loaded(client)) == digest
