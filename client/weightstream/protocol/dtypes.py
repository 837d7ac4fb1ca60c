"""Element types as each layer spells them: safetensors' names, the wire's DataType, torch's dtypes.

Both sides import this table, so that a dtype is defined once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from weightstream.v1 import weightstream_pb2 as pb


@dataclass(frozen=True)
class DType:
    """One element type as each layer spells it."""

    safetensors: str
    wire: pb.DataType
    torch: torch.dtype
    itemsize: int


_DTYPES: tuple[DType, ...] = (
    DType("BOOL", pb.DATA_TYPE_BOOL, torch.bool, 1),
    DType("U8", pb.DATA_TYPE_UINT8, torch.uint8, 1),
    DType("I8", pb.DATA_TYPE_INT8, torch.int8, 1),
    DType("I16", pb.DATA_TYPE_INT16, torch.int16, 2),
    DType("U16", pb.DATA_TYPE_UINT16, torch.uint16, 2),
    DType("I32", pb.DATA_TYPE_INT32, torch.int32, 4),
    DType("U32", pb.DATA_TYPE_UINT32, torch.uint32, 4),
    DType("I64", pb.DATA_TYPE_INT64, torch.int64, 8),
    DType("U64", pb.DATA_TYPE_UINT64, torch.uint64, 8),
    DType("F16", pb.DATA_TYPE_FLOAT16, torch.float16, 2),
    DType("BF16", pb.DATA_TYPE_BFLOAT16, torch.bfloat16, 2),
    DType("F32", pb.DATA_TYPE_FLOAT32, torch.float32, 4),
    DType("F64", pb.DATA_TYPE_FLOAT64, torch.float64, 8),
    DType("F8_E4M3", pb.DATA_TYPE_FLOAT8_E4M3FN, torch.float8_e4m3fn, 1),
    DType("F8_E5M2", pb.DATA_TYPE_FLOAT8_E5M2, torch.float8_e5m2, 1),
)
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _DTYPES}
BY_WIRE: dict[int, DType] = {d.wire: d for d in _DTYPES}
BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in _DTYPES}
