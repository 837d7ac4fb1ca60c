"""weightstream: stream safetensors checkpoints over gRPC straight into a model's parameters.

The client lives in :mod:`weightstream.client`, the server in :mod:`weightstream_server`; this
package holds what both share (the wire helpers and the generated gRPC code) and the CLI.
"""

from __future__ import annotations

from weightstream._version import __version__

__all__ = ["__version__"]
