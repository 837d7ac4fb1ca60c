"""Fetching a model's files into a local folder: weights and companion files, bit-identical, resumable.

Each file is written to DIR/.NAME.partial and renamed to DIR/NAME only once its size and the
CRC32C of its whole content match what the server says. A later fetch skips every file already
complete (by size) and continues every .partial file from its length; a .partial file whose
bytes turn out not to match the server's (a stale one from another version) is removed and the
fetch fails, so that the next one starts that file afresh.

One fetch per directory at a time: two fetches into the same directory would append to the same
.partial files.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from weightstream.client.errors import IntegrityError
from weightstream.client.manifest import ModelFile, ModelFileList
from weightstream.client.progress import byte_bar
from weightstream.protocol import wire

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"


class FileSource(Protocol):
    """Where fetch reads a model's files from (files.RemoteFiles: the server)."""

    def list_files(self, model: str) -> ModelFileList: ...

    def read_file(
        self, model: str, name: str, *, offset: int = 0, revision: str = ""
    ) -> Iterator[tuple[bytes, int | None]]: ...


@dataclass(frozen=True)
class FetchReport:
    """What fetch did: every name is a file of directory; bytes counts only what was received."""

    model: str
    directory: Path
    files: list[str] = field(default_factory=list)
    downloaded: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0

    @property
    def gbps(self) -> float:
        """Gigabytes (10^9 bytes) received per second."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def partial_path(directory: Path, name: str) -> Path:
    """Where file name is written until it is complete."""
    return directory / f".{name}{PARTIAL_SUFFIX}"


def fetch(
    source: FileSource,
    model: str,
    directory: str | Path,
    *,
    metadata_only: bool = False,
    progress: bool = True,
) -> FetchReport:
    """Write model's weight and companion files (only the companions with metadata_only) into directory.

    progress draws a bar (the caller has asked progress.is_rank_zero). Raises the client's
    WeightStreamError subclasses; whatever was received before an error stays in .partial files
    for the next fetch to continue.
    """
    started = time.perf_counter()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    listing = source.list_files(model)
    wanted = [f for f in listing.files if not metadata_only or f.kind == "companion"]
    skipped = [f.name for f in wanted if _is_complete(directory / f.name, f)]
    offsets = {f.name: _resume_offset(directory, f) for f in wanted if f.name not in skipped}
    total = sum(f.size - offsets[f.name] for f in wanted if f.name in offsets)
    downloaded: list[str] = []
    resumed: list[str] = []
    received = 0
    with byte_bar(total, f"fetch {model}", progress) as bar:
        for f in wanted:
            if f.name not in offsets:
                continue
            offset = offsets[f.name]
            received += _fetch_file(source, listing, f, directory, offset, bar)
            (resumed if offset else downloaded).append(f.name)
    report = FetchReport(
        listing.model,
        directory,
        [f.name for f in wanted],
        downloaded,
        resumed,
        skipped,
        received,
        time.perf_counter() - started,
    )
    logger.info(
        "fetched %s into %s: %d files (%d downloaded, %d resumed, %d already complete), %d bytes in %.3f s",
        model,
        directory,
        len(report.files),
        len(downloaded),
        len(resumed),
        len(skipped),
        received,
        report.seconds,
    )
    return report


def _is_complete(path: Path, file: ModelFile) -> bool:
    return path.is_file() and path.stat().st_size == file.size


def _resume_offset(directory: Path, file: ModelFile) -> int:
    """The length of file's .partial file, or 0 (removing it) when there is none or it is too long."""
    partial = partial_path(directory, file.name)
    if not partial.is_file():
        return 0
    size = partial.stat().st_size
    if size > file.size:
        partial.unlink()
        return 0
    return size


def _fetch_file(
    source: FileSource, listing: ModelFileList, file: ModelFile, directory: Path, offset: int, bar: tqdm
) -> int:
    """Receive file from offset into its .partial file, check it whole, rename it; the bytes received."""
    partial = partial_path(directory, file.name)
    where = f"model {listing.model!r}, file {file.name!r}"
    crc = _crc_of_prefix(partial, offset)
    server_crc: int | None = None
    received = 0
    with partial.open("ab" if offset else "wb") as out:
        pieces = source.read_file(listing.model, file.name, offset=offset, revision=listing.revision)
        for data, file_crc in pieces:
            out.write(data)
            crc = wire.crc32c_extend(crc, data)
            received += len(data)
            bar.update(len(data))
            server_crc = file_crc
        # Renamed only once on disk, so a crash never leaves a complete-looking file with missing bytes.
        out.flush()
        os.fsync(out.fileno())
    size = offset + received
    if server_crc is None or size != file.size or server_crc != crc:
        partial.unlink()
        theirs = f"CRC32C {server_crc:#010x}" if server_crc is not None else "no CRC32C"
        raise IntegrityError(
            f"{where}: the received file ({size} bytes, CRC32C {crc:#010x}) does not match the server's "
            f"({file.size} bytes, {theirs}); its partial file was removed, fetch again"
        )
    os.replace(partial, directory / file.name)
    return received


def _crc_of_prefix(partial: Path, length: int) -> int:
    """CRC32C of the first length bytes of partial (0 for none)."""
    if not length:
        return 0
    with partial.open("rb", buffering=0) as f:
        return wire.crc32c_of_range(lambda start, size: os.pread(f.fileno(), size, start), 0, length)[0]
