"""LocalSource: models stored as folders of safetensors files under one model root.

Ids that are absolute or contain ".." are refused as they are (model_ids); every path is then
walked beneath the root (safe_walk) and every file opened through a descriptor (open_files), so
the source never reads outside its root. Each file's bytes are read by the Run:ai streamer from
that descriptor.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from weightstream_server.errors import CheckpointChanged, CorruptCheckpoint, ModelNotFound
from weightstream_server.storage.file_errors import file_error
from weightstream_server.storage.index import INDEX_CACHE_ENTRIES, INDEX_FILE, MAX_INDEX_BYTES, parse_index
from weightstream_server.storage.model_ids import check_model_id
from weightstream_server.storage.open_files import OpenFiles
from weightstream_server.storage.parse_once import ParseOnce
from weightstream_server.storage.safe_walk import SafeWalk
from weightstream_server.storage.sources import COMPANION_FILES, LocalFile, ModelFiles, SourceFile

if TYPE_CHECKING:
    from weightstream_server.storage.reads import ReadPlan


class LocalSource:
    """Models stored as folders of safetensors files under one root directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.realpath(root))
        # An absolute link target is inside the root when it names a path under either spelling.
        self._roots = tuple(dict.fromkeys((str(self.root), os.path.abspath(root))))
        self._indexes: ParseOnce[dict[str, str]] = ParseOnce(
            max_weight=INDEX_CACHE_ENTRIES, keep_results=True, weight=len
        )

    def claims(self, model: str) -> bool:
        return "://" not in model

    def describe(self) -> str:
        return f"model root {self.root}"

    def read_range(self, file: SourceFile, start: int, length: int) -> bytes:
        """One ranged read, through a descriptor opened beneath the root for it (streams hold OpenFiles instead)."""
        model = file.local.relative.rpartition("/")[0] if file.local is not None else file.path
        with OpenFiles(self, model, {0: file}) as opened:
            return opened.read_range(0, start, length)

    def public_name(self) -> str:
        return "model root"

    def read_units(self, files: Sequence[SourceFile], plan: ReadPlan) -> None:
        return None

    def reachable(self) -> bool:
        return self.root.is_dir() and os.access(self.root, os.R_OK | os.X_OK)

    def resolve(self, model: str) -> ModelFiles:
        """The files of model, checked to lie inside the root and to be regular files, before any is read."""
        with self._folder(model) as folder:
            weight_map = self._read_index(model, folder)
            if weight_map is not None:
                names = sorted(set(weight_map.values()))
            else:
                try:
                    listed = os.listdir(folder.fd)
                except OSError as exc:
                    raise file_error(exc, f"model {model!r}") from exc
                names = sorted(name for name in listed if name.endswith(".safetensors"))
            if not names:
                raise ModelNotFound(f"model {model!r} has no *.safetensors files")
            files = tuple(self._file(model, folder, name, f"model {model!r}: file {name!r}") for name in names)
        return ModelFiles(model, files, weight_map)

    def companion_files(self, model: str) -> tuple[SourceFile, ...]:
        with self._folder(model) as folder:
            # Any entry under an allowed name is checked (a dangling or escaping link is refused, not skipped).
            present = [name for name in sorted(COMPANION_FILES) if self._entry(model, folder, name) is not None]
            return tuple(self._file(model, folder, name, f"model {model!r}: file {name!r}") for name in present)

    def _walk(self) -> SafeWalk:
        return SafeWalk(self._roots)

    def _folder(self, model: str) -> SafeWalk:
        """A walk standing in model's folder; the caller closes it."""
        check_model_id(model)
        what = f"model {model!r}"
        try:
            walk = self._walk()
        except OSError as exc:
            raise file_error(exc, what) from exc
        try:
            if walk.follow(model, what) is not None:
                raise ModelNotFound(f"model {model!r} not found")
        except OSError as exc:
            walk.close()
            raise file_error(exc, what) from exc
        except BaseException:
            walk.close()
            raise
        return walk

    def _entry(self, model: str, folder: SafeWalk, name: str) -> os.stat_result | None:
        """The lstat of name in folder, None if there is none."""
        try:
            return os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise file_error(exc, f"model {model!r}: file {name!r}") from exc

    def _read_index(self, model: str, folder: SafeWalk) -> dict[str, str] | None:
        what = f"model {model!r}: {INDEX_FILE}"
        if self._entry(model, folder, INDEX_FILE) is None:
            return None
        index = self._file(model, folder, INDEX_FILE, what)
        if index.size > MAX_INDEX_BYTES:
            raise CorruptCheckpoint(f"{what} is larger than {MAX_INDEX_BYTES} bytes")

        def parse() -> dict[str, str]:
            with OpenFiles(self, model, {0: index}) as opened:
                raw = opened.read_range(0, 0, index.size)
                opened.check_unchanged(0)
            if len(raw) != index.size:
                raise CheckpointChanged(f"{what} is shorter than when it was listed; it changed on disk")
            return parse_index(model, raw)

        return self._indexes.get(index.path, index.fingerprint, parse)

    def _file(self, model: str, folder: SafeWalk, name: str, what: str) -> SourceFile:
        """The listed file name in folder: followed beneath the root if it is a link, checked to be a regular file."""
        relative = f"{model}/{name}"
        try:
            entry = os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
            resolved = f"{folder.relative}/{name}"
            if stat.S_ISLNK(entry.st_mode):
                with self._walk() as walk:
                    leaf = walk.follow(relative, what)
                    if leaf is None:
                        raise CorruptCheckpoint(f"{what} is not a regular file (it is a folder)")
                    resolved = f"{walk.relative}/{leaf[0]}"
                    entry = leaf[1]
        except OSError as exc:
            raise file_error(exc, what) from exc
        if not stat.S_ISREG(entry.st_mode):
            raise CorruptCheckpoint(f"{what} is not a regular file")
        local = LocalFile(self._roots, relative, entry.st_dev, entry.st_ino, entry.st_mtime_ns, entry.st_ctime_ns)
        return SourceFile(name, str(self.root / resolved.lstrip("/")), entry.st_size, str(entry.st_mtime_ns), local)
