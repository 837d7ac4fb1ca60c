"""The weightstream server: serves safetensors checkpoints as gRPC streams of tensor chunks."""

from __future__ import annotations

from weightstream_server.grpc_server import WeightStreamServer, create_server
from weightstream_server.settings import ServerSettings

__all__ = ["ServerSettings", "WeightStreamServer", "create_server"]
