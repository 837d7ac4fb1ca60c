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


class TensorHasher:
    """The hash of one tensor's bytes, fed in order, in pieces of any size."""

    def __init__(self) -> None:
        self._tensor = blake3()
        self._block = blake3()
        self._in_block = 0

    def update(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            take = min(DIGEST_BLOCK_BYTES - self._in_block, len(data) - done)
            self._block.update(data[done : done + take])
            self._in_block += take
            done += take
            if self._in_block == DIGEST_BLOCK_BYTES:
                self._next_block()

    def digest(self) -> bytes:
        if self._in_block:
            self._next_block()
        return self._tensor.digest()

    def _next_block(self) -> None:
        self._tensor.update(self._block.digest())
        self._block = blake3()
        self._in_block = 0


def tensor_hash(data: memoryview) -> bytes:
    """The hash of a tensor's bytes (flat, as the checkpoint holds them)."""
    hasher = TensorHasher()
    hasher.update(data)
    return hasher.digest()


def revision_digest(tensors: Iterable[tuple[str, str, Sequence[int], bytes]]) -> str:
    """The digest of a revision from (name, safetensors dtype, shape, tensor_hash) of each tensor, in order."""
    digest = blake3()
    for name, dtype, shape, hashed in tensors:
        digest.update(f"{name}\0{dtype}\0{','.join(str(int(d)) for d in shape)}\0".encode())
        digest.update(hashed)
    return PREFIX + digest.hexdigest()
