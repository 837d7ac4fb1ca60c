"""A model.safetensors.index.json: its bounds, and its weight map parsed and checked."""

from __future__ import annotations

import json
import re

from weightstream_server.errors import CorruptCheckpoint

INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 * 1024 * 1024
# Items ("{", "[" or ",") are counted before an index is parsed, as for headers (header.py): parsed, an
# entry of the weight map costs a few hundred bytes of Python objects. The largest open checkpoints
# list about 100,000 tensors; an index at this bound costs about 150 MB while it is parsed.
MAX_INDEX_ITEMS = 500_000
# Parsed weight maps a source keeps (one per index file, its latest version), bounded by their entries in all.
INDEX_CACHE_ENTRIES = 2 * MAX_INDEX_ITEMS
_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*\.safetensors")
_QUOTED_CHARS = 80


def parse_index(model: str, raw: bytes) -> dict[str, str]:
    """The weight_map of a model.safetensors.index.json, checked to name only plain *.safetensors files.

    Its items are counted before it is parsed (MAX_INDEX_ITEMS); any JSON it cannot be parsed as
    (nested too deeply, a number too long to convert, not UTF-8) is CorruptCheckpoint.
    """
    what = f"model {model!r}: {INDEX_FILE}"
    items = raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    if items > MAX_INDEX_ITEMS:
        raise CorruptCheckpoint(f"{what} holds {items} JSON items, more than {MAX_INDEX_ITEMS}; refused unparsed")
    try:
        index = json.loads(raw)
    except RecursionError as exc:
        raise CorruptCheckpoint(f"{what} is not valid JSON: nested too deeply") from exc
    except ValueError as exc:
        # JSONDecodeError and UnicodeDecodeError, and also the integer of more than 4300 digits that int() refuses.
        raise CorruptCheckpoint(f"{what} is not valid JSON: {str(exc)[:_QUOTED_CHARS]}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CorruptCheckpoint(f"{what} has no valid weight_map")
    # A few file names repeated for every tensor: kept once each.
    names: dict[str, str] = {}
    weight_map = {tensor: names.setdefault(file_name, file_name) for tensor, file_name in weight_map.items()}
    for file_name in names:
        if not _FILE_NAME.fullmatch(file_name):
            raise CorruptCheckpoint(
                f"{what} names file {file_name[:80]!r}, which is not a plain *.safetensors name in the model folder"
            )
    return weight_map
