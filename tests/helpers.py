"""Test helpers: writing safetensors files by hand (including broken ones)."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def write_raw_safetensors(path: Path, header: dict[str, object], data: bytes) -> None:
    """Write a safetensors file with exactly this header and data section, valid or not."""
    encoded = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
