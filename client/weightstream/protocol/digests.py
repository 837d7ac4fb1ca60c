"""A revision's cryptographic identity: BLAKE3 over its tensors' block hashes, the same on both sides.

CRC32C checks each chunk against transmission errors, but anyone who can send bytes can make a CRC
match. A revision's digest is what proves which bytes a holder has: each tensor's bytes are hashed
per DIGEST_BLOCK_BYTES block (BLAKE3), the tensor's hash is BLAKE3 over its block hashes, and the
revision's digest is BLAKE3 over each tensor's name, dtype, shape and hash, in the revision's order.
The server computes it as a revision's bytes arrive (or as a storage revision's files are digested)
and serves it with the manifest; a client (revision_digest over the tensors it holds) or a peer
computes the same from the bytes it holds and compares.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from blake3 import blake3

DIGEST_BLOCK_BYTES = 1024 * 1024
PREFIX = "blake3:"


def block_hash(block: memoryview) -> bytes:
    """The BLAKE3 of one DIGEST_BLOCK_BYTES block of a tensor (its last may be shorter)."""
    return blake3(block).digest()


def hash_of_blocks(block_hashes: Iterable[bytes]) -> bytes:
    """A tensor's hash from its blocks' hashes, in order (what tensor_hash computes from its bytes)."""
    digest = blake3()
    for hashed in block_hashes:
        digest.update(hashed)
    return digest.digest()


def tensor_hash(data: memoryview) -> bytes:
    """The hash of a tensor's bytes (flat, as the checkpoint holds them)."""
    step = DIGEST_BLOCK_BYTES
    return hash_of_blocks(block_hash(data[start : start + step]) for start in range(0, len(data), step))


def revision_digest(tensors: Iterable[tuple[str, str, Sequence[int], bytes]]) -> str:
    """The digest of a revision from (name, safetensors dtype, shape, tensor_hash) of each tensor, in order."""
    digest = blake3()
    for name, dtype, shape, hashed in tensors:
        digest.update(f"{name}\0{dtype}\0{','.join(str(int(d)) for d in shape)}\0".encode())
        digest.update(hashed)
    return PREFIX + digest.hexdigest()
