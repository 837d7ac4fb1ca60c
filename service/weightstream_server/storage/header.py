"""Reading and checking safetensors headers.

A safetensors file is an 8-byte little-endian header length, a JSON header, then the tensor data.
Every check a hostile or damaged file could fail is made here, before any tensor byte is read.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from weightstream.protocol import dtypes, wire
from weightstream_server.errors import CorruptCheckpoint, UnsupportedCheckpoint

# Real headers are kilobytes to a few MiB (hundreds of thousands of tensors); a larger one is
# refused before it is read, so that a hostile file cannot make the server parse gigabytes of JSON.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Parsed JSON costs up to about 80 bytes of Python objects per item ("[]," is 3 bytes of header), so
# items are counted before parsing: a hostile header of tiny items would otherwise take gigabytes.
# 2 million items (an opening "[" or "{", or a ",") hold about 200,000 tensors, far more than a
# real file has; a header at this bound costs about 200 MB while it is parsed, nothing after.
MAX_HEADER_ITEMS = 2_000_000
MAX_NAME_CHARS = 1024
MAX_DIMS = 16
# Every dtype the safetensors format defines; those torch cannot hold (not in dtypes.BY_SAFETENSORS)
# make a checkpoint unsupported, any other string makes it corrupt.
SAFETENSORS_DTYPES = frozenset(
    {"BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64", "F16", "BF16", "F32", "F64"}
    | {"F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4", "C64"}
)
# Error messages travel in gRPC trailers (8 KiB by default), so values quoted in them are cut.
_QUOTED_CHARS = 80
# JSON's white space.
_SPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True, slots=True)
class HeaderTensor:
    """One tensor of one file; start and end are absolute byte offsets in the file."""

    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(read_range: Callable[[int, int], bytes], file_size: int, display_name: str) -> list[HeaderTensor]:
    """Parse and check the header of a safetensors file of file_size bytes, in data-offset order.

    read_range(start, length) reads the file's bytes (a local read or a ranged GET); only the
    length prefix and the header are read. display_name is how errors name the file (the model id
    and file name, never a server path or credentials).
    """
    if file_size < 8:
        raise CorruptCheckpoint(f"{display_name}: file is {file_size} bytes, too short for a header")
    prefix = read_range(0, 8)
    if len(prefix) < 8:
        raise CorruptCheckpoint(f"{display_name}: truncated: read {len(prefix)} of 8 header-length bytes")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len < 2 or header_len > MAX_HEADER_BYTES:
        raise CorruptCheckpoint(f"{display_name}: header length {header_len} is outside 2..{MAX_HEADER_BYTES} bytes")
    if 8 + header_len > file_size:
        raise CorruptCheckpoint(f"{display_name}: truncated: header of {header_len} bytes, file of {file_size} bytes")
    raw = read_range(8, header_len)
    if len(raw) != header_len:
        raise CorruptCheckpoint(f"{display_name}: truncated: read {len(raw)} of {header_len} header bytes")
    items = raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    if items > MAX_HEADER_ITEMS:
        raise CorruptCheckpoint(
            f"{display_name}: header holds {items} JSON items, more than {MAX_HEADER_ITEMS}; refused unparsed"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpoint(f"{display_name}: header is not UTF-8: {exc}") from exc
    # Dropped before parsing, so that a large header is held once (as text), not twice.
    del raw
    data_start = 8 + header_len
    data_size = file_size - data_start
    # Each entry is decoded alone and checked at once: the header is never held as parsed JSON whole
    # (its text and the checked tensors are), and a name given twice keeps its last entry, as JSON does.
    by_name: dict[str, HeaderTensor] = {}
    for name, entry in _entries(display_name, text):
        if name != "__metadata__":
            by_name[name] = _parse_entry(display_name, name, entry, data_start, data_size)
    del text
    tensors = list(by_name.values())
    del by_name
    tensors.sort(key=lambda t: (t.start, t.end))
    previous: HeaderTensor | None = None
    for tensor in tensors:
        if tensor.nbytes == 0:
            continue
        if previous is not None and tensor.start < previous.end:
            raise CorruptCheckpoint(
                f"{display_name}: tensors {previous.name!r} and {tensor.name!r} overlap "
                f"(bytes {previous.start - data_start}..{previous.end - data_start} and "
                f"{tensor.start - data_start}..{tensor.end - data_start} of the data section)"
            )
        previous = tensor
    return tensors


def _entries(display_name: str, text: str) -> Iterator[tuple[str, object]]:
    """The (name, value) pairs of the JSON object text, each value decoded on its own, in order."""
    decoder = json.JSONDecoder()
    at = _skip_space(text, 0)
    if text[at : at + 1] != "{":
        try:
            json.loads(text)
        except (RecursionError, ValueError) as exc:
            raise _invalid(display_name, exc) from exc
        raise CorruptCheckpoint(f"{display_name}: header is not a JSON object")
    at = _skip_space(text, at + 1)
    if text[at : at + 1] == "}":
        at = _skip_space(text, at + 1)
    else:
        while True:
            try:
                if text[at : at + 1] != '"':
                    raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, at)
                name, at = decoder.raw_decode(text, at)
                at = _skip_space(text, at)
                if text[at : at + 1] != ":":
                    raise json.JSONDecodeError("Expecting ':' delimiter", text, at)
                value, at = decoder.raw_decode(text, _skip_space(text, at + 1))
            except (RecursionError, ValueError) as exc:
                raise _invalid(display_name, exc) from exc
            yield name, value
            at = _skip_space(text, at)
            if text[at : at + 1] == ",":
                at = _skip_space(text, at + 1)
                continue
            if text[at : at + 1] == "}":
                at = _skip_space(text, at + 1)
                break
            raise _invalid(display_name, json.JSONDecodeError("Expecting ',' delimiter", text, at))
    if at != len(text):
        raise _invalid(display_name, json.JSONDecodeError("Extra data", text, at))


def _skip_space(text: str, at: int) -> int:
    match = _SPACE.match(text, at)
    return match.end() if match else at


def _invalid(display_name: str, exc: BaseException) -> CorruptCheckpoint:
    if isinstance(exc, RecursionError):
        return CorruptCheckpoint(f"{display_name}: header is not valid JSON: nested too deeply")
    # JSONDecodeError, and also the integer of more than 4300 digits that int() refuses.
    return CorruptCheckpoint(f"{display_name}: header is not valid JSON: {str(exc)[:_QUOTED_CHARS]}")


def _quote(value: object) -> str:
    try:
        text = str(value)
    except ValueError:
        # An int of more than 4300 digits (a product of huge dimensions) refuses str().
        return "(a number too long to print)"
    return text if len(text) <= _QUOTED_CHARS else text[:_QUOTED_CHARS] + "..."


def _encodable(name: str) -> bool:
    # JSON may escape a lone surrogate ("\\ud800"), which no protobuf string or chunk frame can carry.
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _parse_entry(display_name: str, name: object, entry: object, data_start: int, data_size: int) -> HeaderTensor:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or "\x00" in name or not _encodable(name):
        raise CorruptCheckpoint(f"{display_name}: invalid tensor name {str(name)[:_QUOTED_CHARS]!r}")
    if not isinstance(entry, dict):
        raise CorruptCheckpoint(f"{display_name}: tensor {name!r}: entry is not a JSON object")
    dtype_code = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if not isinstance(dtype_code, str):
        raise CorruptCheckpoint(f"{display_name}: tensor {name!r}: missing dtype")
    dtype = dtypes.BY_SAFETENSORS.get(dtype_code)
    if dtype is None and dtype_code not in SAFETENSORS_DTYPES:
        raise CorruptCheckpoint(
            f"{display_name}: tensor {name!r}: unknown dtype {dtype_code[:_QUOTED_CHARS]!r}, not a safetensors dtype"
        )
    if dtype is None:
        raise UnsupportedCheckpoint(
            f"{display_name}: tensor {name!r}: unsupported dtype {dtype_code[:_QUOTED_CHARS]!r}"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise CorruptCheckpoint(f"{display_name}: tensor {name!r}: invalid shape {_quote(shape)}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CorruptCheckpoint(f"{display_name}: tensor {name!r}: invalid data_offsets {_quote(offsets)}")
    begin, end = offsets
    expected = wire.numel(tuple(shape)) * dtype.itemsize
    if end - begin != expected:
        raise CorruptCheckpoint(
            f"{display_name}: tensor {name!r}: data_offsets span {_quote(end - begin)} bytes, "
            f"but shape {_quote(shape)} of {dtype_code} needs {_quote(expected)}"
        )
    if end > data_size:
        raise CorruptCheckpoint(
            f"{display_name}: truncated or bad offsets: tensor {name!r} ends at byte {_quote(end)} of the "
            f"data section, which holds {data_size} bytes"
        )
    return HeaderTensor(name, dtype, tuple(shape), data_start + begin, data_start + end)
