"""The names both sides give to the choices on the wire: transports and kinds of model file.

Each is one Literal type, used in code, CLI choices, settings, metrics and docs alike, and mapped
to and from the protobuf enums in one table each.
"""

from __future__ import annotations

from typing import Literal, get_args

from weightstream.v1 import weightstream_pb2 as pb

# A data path of one stream: in the gRPC messages, through a shared-memory ring on the same host,
# or over a TCP (or TLS) connection to the server's data port.
TransportName = Literal["grpc", "shm", "tcp"]
# What a client may ask for: one of those, or "auto" (shm, else tcp, else grpc).
TransportChoice = Literal["auto", "grpc", "shm", "tcp"]
TRANSPORTS: tuple[TransportChoice, ...] = get_args(TransportChoice)

# A model's files: safetensors weights, or the companions an engine reads (config, tokenizer, index).
FileKind = Literal["weights", "companion"]
FILE_KINDS: dict[FileKind, pb.ModelFileKind] = {
    "weights": pb.MODEL_FILE_KIND_WEIGHTS,
    "companion": pb.MODEL_FILE_KIND_COMPANION,
}
FILE_KINDS_BY_WIRE: dict[int, FileKind] = {wire: kind for kind, wire in FILE_KINDS.items()}
