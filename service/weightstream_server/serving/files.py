"""Whole files of a model, for fetch: which files a client may read, and reading them in chunks.

A client may read a model's weight files (the *.safetensors files of its manifest) and the
companion files of source.COMPANION_FILES that are present, each of the latter up to
MAX_COMPANION_BYTES. Every other name is refused before storage is asked for it. Bytes are read
with plain ranged reads (not the Run:ai streamer; fetch is not the hot path), of a local file
through one descriptor opened beneath the model root for the whole call (source.OpenFiles), which
is checked against the listing before the last piece goes out.

The whole-file CRC32C that ends a read is computed once per version of a file (its fingerprint)
and kept (at most CHECKSUMS_KEPT files, for the life of the process): a read from an offset then
reads only the bytes it sends. A read from offset 0 checksums what it sends; the first read of a
version from an offset reads the whole file once for it, before its first piece, single-flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from weightstream.protocol import wire
from weightstream.protocol.names import FileKind
from weightstream_server.errors import (
    AccessDenied,
    CorruptCheckpoint,
    FileNotFound,
    FileTooLarge,
    InvalidRequest,
    RangeOutOfBounds,
    RevisionMismatch,
)
from weightstream_server.serving.cache import UnitCache
from weightstream_server.serving.catalog import Catalog
from weightstream_server.serving.checksums import KeptChecksums
from weightstream_server.storage.open_files import OpenFiles
from weightstream_server.storage.parse_once import ParseOnce
from weightstream_server.storage.sources import COMPANION_FILES, Source, SourceFile, revision

# Companion files are configs and tokenizers (a few MB at most); a larger one is refused rather
# than sent, so that an allowed name cannot be used to pull a large private file.
MAX_COMPANION_BYTES = 64 * 1024 * 1024
# Whole-file CRC32Cs kept (about 150 bytes each); the least recently used go first.
CHECKSUMS_KEPT = 65_536


@dataclass(frozen=True)
class ListedFile:
    file: SourceFile
    kind: FileKind


@dataclass(frozen=True)
class FileListing:
    """The readable files of one model, from one source, and a revision covering all of them."""

    model: str
    revision: str
    source: Source
    files: tuple[ListedFile, ...]

    def get(self, name: str) -> ListedFile:
        """The listed file called name, checked to be servable; raises ServerError naming it."""
        for listed in self.files:
            if listed.file.name == name:
                if listed.kind == "companion" and listed.file.size > MAX_COMPANION_BYTES:
                    raise FileTooLarge(
                        f"model {self.model!r}: companion file {name!r} has {listed.file.size} bytes, more than "
                        f"the {MAX_COMPANION_BYTES} this server serves; refused"
                    )
                return listed
        if name in COMPANION_FILES:
            raise FileNotFound(f"model {self.model!r} has no file {name!r}")
        raise AccessDenied(
            f"model {self.model!r}: file {name!r} is neither a weight file of the model nor an allowed companion "
            f"file ({', '.join(sorted(COMPANION_FILES))}); refused"
        )


@dataclass(frozen=True)
class FilePiece:
    """data read from offset; file_crc32c (CRC32C of the whole file) is set on the last piece only.

    read_before: bytes read from storage before this piece only for file_crc32c, never sent (the
    bytes before the offset, on the first piece of a read whose checksum was not yet known).
    read: the bytes of data read from storage for this piece (0 when the cache had them).
    """

    offset: int
    data: bytes
    crc32c: int
    file_crc32c: int | None
    read_before: int = 0
    read: int = 0


# Whole-file CRC32Cs by file version (path, size, fingerprint).
# Whole-file CRC32Cs being computed from the start of a file for reads from an offset: one per version at a time.
_whole_file_crcs: ParseOnce[int] = ParseOnce(max_weight=CHECKSUMS_KEPT, keep_results=False)
_checksums: KeptChecksums[tuple[str, int, str]] = KeptChecksums(CHECKSUMS_KEPT)


def check_file_name(model: str, name: str) -> None:
    """Refuse a file name that is not one plain name (no "/", no "..", not hidden)."""
    if not wire.is_plain_file_name(name):
        raise InvalidRequest(
            f"model {model[:200]!r}: invalid file name {name[:80]!r}: use a plain name of letters, digits, "
            "'.', '_' and '-', with no '/' or '..' and no leading '.'"
        )


def list_files(catalog: Catalog, model: str) -> FileListing:
    """Every file of model a client may read: its weight files, then its companion files."""
    source = catalog.source_for(model)
    # Weight names end in .safetensors and companion names never do, so no name is listed twice.
    files = tuple(ListedFile(f, "weights") for f in source.resolve(model).files) + tuple(
        ListedFile(f, "companion") for f in source.companion_files(model)
    )
    return FileListing(model, revision([f.file for f in files], [f.kind for f in files]), source, files)


def read_file(
    catalog: Catalog,
    model: str,
    name: str,
    offset: int,
    revision: str,
    chunk_bytes: int,
    *,
    length: int = 0,
    cache: UnitCache | None = None,
) -> Iterator[FilePiece]:
    """Model's file name from offset, length bytes (0: to the end), in pieces of at most chunk_bytes.

    A read to the end carries the whole-file CRC32C on its last piece, covering bytes 0..offset as
    well, so that a client resuming from a stale partial file notices: kept from an earlier read of
    the same version of the file, or else computed here, reading (not sending) the bytes before
    offset. With a cache, the pieces of weight files are read through it, single-flight: servers
    that read from this one (--upstream) and fill their disk caches at the same time read the
    storage once.
    """
    check_file_name(model, name)
    listing = list_files(catalog, model)
    if revision and revision != listing.revision:
        raise RevisionMismatch(
            f"model {model!r} changed: files revision {listing.revision}, the request expects {revision}"
        )
    listed = listing.get(name)
    file = listed.file
    if offset > file.size:
        raise RangeOutOfBounds(f"model {model!r}: offset {offset} is past the end of {name!r} ({file.size} bytes)")
    if length and offset + length > file.size:
        raise RangeOutOfBounds(
            f"model {model!r}: bytes {offset}..{offset + length} are past the end of {name!r} ({file.size} bytes)"
        )
    end = offset + length if length else file.size
    to_end = end == file.size
    display = f"model {model!r}, file {name!r}"
    through = cache if listed.kind == "weights" else None
    with OpenFiles(listing.source, model, {0: file}) as opened:
        key = (file.path, file.size, file.fingerprint)
        known = _checksums.get(key) if to_end else None
        crc = 0
        read_before = 0
        if to_end and known is None and offset:
            # From an offset the CRC32C needs the bytes before it: computed whole, once per version
            # however many reads ask at once, and kept before any piece goes out, so that a client
            # that takes one piece and cancels cannot make the next read of the file read it again.
            computed: list[int] = []

            def whole_file_crc() -> int:
                whole, done = wire.crc32c_of_range(
                    lambda start, size: _read(opened, start, size, display), 0, file.size, block_bytes=chunk_bytes
                )
                opened.check_unchanged(0)
                computed.append(done)
                _checksums.put(key, whole)
                return whole

            known = _whole_file_crcs.get(file.path, f"{file.size}:{file.fingerprint}", whole_file_crc)
            read_before = computed[0] if computed else 0
        pieces = list(wire.split_range(offset, end, chunk_bytes)) or [(offset, 0)]
        for index, (start, size) in enumerate(pieces):
            data, read_here = _piece(opened, file, start, size, display, through)
            last = index == len(pieces) - 1
            if to_end and known is None:
                crc = wire.crc32c_extend(crc, data)
            whole: int | None = None
            if last:
                # Before the last piece goes out: a file changed while it was read never ends a read OK.
                opened.check_unchanged(0)
                if to_end and known is None:
                    _checksums.put(key, crc)
                if to_end:
                    whole = crc if known is None else known
            yield FilePiece(
                start, data, wire.crc32c(data), whole, read_before if index == 0 else 0, size if read_here else 0
            )


def _piece(
    opened: OpenFiles, file: SourceFile, start: int, size: int, display: str, cache: UnitCache | None
) -> tuple[bytes, bool]:
    """The bytes of one piece, and whether they were read from storage here (not taken from the cache)."""
    if not size:
        return b"", False
    if cache is None:
        return _read(opened, start, size, display), True
    read: list[bytes] = []

    def read_piece() -> np.ndarray:
        read.append(_read(opened, start, size, display))
        return np.frombuffer(read[0], dtype=np.uint8)

    unit, read_here = cache.get_or_read((file.path, file.size, file.fingerprint, start, size), read_piece)
    # The bytes read here go out as they are; only a piece another read kept is copied out of the cache.
    return (read[0] if read else unit.data.tobytes()), read_here


def _read(opened: OpenFiles, start: int, length: int, display: str) -> bytes:
    data = opened.read_range(0, start, length)
    if len(data) != length:
        opened.check_unchanged(0)
        raise CorruptCheckpoint(
            f"{display}: read {len(data)} bytes at offset {start} where {length} were listed; "
            "the file is shorter than listed"
        )
    return data
