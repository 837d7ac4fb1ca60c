"""Where a published part's tensors lie in its buffer, and how big that buffer is: one function says both.

Each tensor starts on an ALIGN-byte boundary (so that a view of it of any dtype is aligned), and the
buffer's size is where the last tensor's padding ends. The buffer is allocated with Layout.nbytes
and written only through a weightstream.protocol.memory.Region over it, so a tensor placed by
lay_out always fits, and a write that would not is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from weightstream.protocol import dtypes
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import InvalidRequest

# Tensors of a part start on this boundary in its buffer.
ALIGN = 64
# The longest tensor name a publish may announce.
MAX_TENSOR_NAME = 1024
# The most tensors one part may announce (a request may name as many).
MAX_TENSORS_PER_PART = 1_000_000
# Memory a tensor of a published revision costs besides its bytes (its entries, names and block
# checksums), counted against --publish-max-bytes so that empty tensors are not free.
TENSOR_OVERHEAD_BYTES = 512


@dataclass(frozen=True)
class Placed:
    """One announced tensor and where its bytes lie in the part's buffer."""

    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    nbytes: int
    offset: int


@dataclass(frozen=True)
class Layout:
    """A part's tensors by name, placed, and the bytes its buffer needs to hold them all."""

    tensors: dict[str, Placed]
    nbytes: int

    @property
    def accounted_bytes(self) -> int:
        """What the part counts against --publish-max-bytes: its buffer and each tensor's overhead."""
        return self.nbytes + len(self.tensors) * TENSOR_OVERHEAD_BYTES


def lay_out(model: str, announced: Sequence[pb.PublishedTensor]) -> Layout:
    """The part's tensors placed in its buffer; InvalidRequest names a bad name, dtype or shape."""
    if len(announced) > MAX_TENSORS_PER_PART:
        raise InvalidRequest(
            f"publish of model {model!r}: a part announces {len(announced)} tensors, more than {MAX_TENSORS_PER_PART}"
        )
    tensors: dict[str, Placed] = {}
    offset = 0
    for tensor in announced:
        if not tensor.name or len(tensor.name) > MAX_TENSOR_NAME:
            raise InvalidRequest(f"publish of model {model!r}: a tensor name is 1 to {MAX_TENSOR_NAME} characters")
        if tensor.name in tensors:
            raise InvalidRequest(f"publish of model {model!r}: tensor {tensor.name[:200]!r} announced twice")
        dtype = dtypes.BY_WIRE.get(tensor.dtype)
        if dtype is None:
            raise InvalidRequest(f"publish of model {model!r}: tensor {tensor.name!r}: unknown dtype {tensor.dtype}")
        shape = tuple(int(d) for d in tensor.shape)
        if len(shape) > 16 or any(d > 1 << 40 for d in shape):
            raise InvalidRequest(f"publish of model {model!r}: tensor {tensor.name!r}: shape {list(shape)[:20]}")
        nbytes = math.prod(shape) * dtype.itemsize
        tensors[tensor.name] = Placed(tensor.name, dtype, shape, nbytes, offset)
        offset += nbytes + (-nbytes % ALIGN)
    return Layout(tensors, offset)
