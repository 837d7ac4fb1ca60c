"""The installed distribution's version (pyproject.toml's [project] version is the one place it is set)."""

from __future__ import annotations

from importlib import metadata

try:
    __version__ = metadata.version("weightstream")
except metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"
