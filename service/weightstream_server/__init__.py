"""The weightstream server: serves safetensors checkpoints as gRPC streams of tensor chunks."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightstream_server.assembly import WeightStreamServer, create_server
    from weightstream_server.settings import ServerSettings

__all__ = ["ServerSettings", "WeightStreamServer", "create_server"]

# Imported on first use: the CLI builds `serve`'s options from ServerSettings, and `weightstream
# --help` should not wait for the streamer and torch that the server itself needs.
_WHERE = {
    "ServerSettings": "weightstream_server.settings",
    "WeightStreamServer": "weightstream_server.assembly",
    "create_server": "weightstream_server.assembly",
}


def __getattr__(name: str) -> object:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(where), name)
