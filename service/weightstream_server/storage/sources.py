"""Where checkpoints live: a Source resolves a model id to its safetensors files; OpenFiles reads their bytes.

Next to its weights a model folder may hold companion files (config, tokenizer, index) that an
engine needs; a source lists only those named in COMPANION_FILES, never anything else in the folder.

LocalSource serves folders under a model root and never reads outside it. Ids that are absolute or
contain ".." are refused as they are. Every path under the root is then walked one component at a
time from a descriptor of the root, each directory opened with O_NOFOLLOW relative to the one
before; a symlink met on the way is read and its target walked the same way, and a target that
leaves the root (an absolute path elsewhere, or ".." above the root) is refused (AccessDenied).
Links that stay inside the root are followed. Only regular files are ever opened (a FIFO or a
device under a checkpoint's name is refused before any open, so it cannot block a worker), and
their bytes are read only through the descriptors so opened (OpenFiles): a file or folder swapped
for a link after the check is never read. Hard links are outside any path check: a hard link inside
the root to a file elsewhere is an ordinary file here.

Each listed local file records its identity (device, inode, size, modification and change times).
OpenFiles checks a descriptor against it when it opens the file and again when its reads end: a
file that is another one, or was rewritten, is CheckpointChanged (FAILED_PRECONDITION), never
served mixed. A rewrite within the file system's timestamp granularity of the previous write leaves
the times as they were, and is not seen.

Every OSError of file access under the root becomes a ServerError in file_error, the one place
errnos are mapped.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol

from weightstream_server.errors import (
    AccessDenied,
    CheckpointChanged,
    CorruptCheckpoint,
    InvalidModelId,
    ModelNotFound,
    ServerError,
    StorageUnavailable,
)

INDEX_FILE = "model.safetensors.index.json"
# The small files served next to a model's weights; every other name in a model folder stays private.
COMPANION_FILES = frozenset(
    {
        "added_tokens.json",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        INDEX_FILE,
        "merges.txt",
        "preprocessor_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
        "vocab.json",
    }
)
MAX_MODEL_ID_CHARS = 512
MAX_INDEX_BYTES = 64 * 1024 * 1024
# Items ("{", "[" or ",") are counted before an index is parsed, as for headers (header.py): parsed, an
# entry of the weight map costs a few hundred bytes of Python objects. The largest open checkpoints
# list about 100,000 tensors; an index at this bound costs about 150 MB while it is parsed.
MAX_INDEX_ITEMS = 500_000
# Parsed weight maps kept (one per model, its latest version), bounded by their entries in all.
INDEX_CACHE_ENTRIES = 2 * MAX_INDEX_ITEMS
# One or more path components of letters, digits, ".", "_" and "-", none starting with a dot:
# this rules out "..", hidden folders, absolute paths and backslashes in one place.
_MODEL_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")
S3_SCHEME = "s3://"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
MAX_PREFIX_CHARS = 1024
_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*\.safetensors")
# Links followed in one walk before it is a loop (the kernel's own bound), and folders a walk may
# stand in at once (it holds a descriptor of each): model folders are a few levels deep.
_MAX_LINKS = 40
_MAX_DEPTH = 64
_QUOTED_CHARS = 80
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: the walk only opens what lstat called a regular file, but a FIFO swapped in between
# must not block the open; it is then refused by fstat.
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# What the Run:ai streamer opens to read a descriptor's file (this process's own descriptors).
_FD_PATH = "/proc/self/fd/{}"


@dataclass(frozen=True)
class LocalFile:
    """Where a file under a model root is opened from, and the identity it had when it was listed.

    roots: the root's real path, then other spellings of it that absolute link targets may use.
    relative: the path below the root as the model id and file name spell it (links are resolved
    anew, beneath the root, at every open).
    """

    roots: tuple[str, ...]
    relative: str
    device: int
    inode: int
    mtime_ns: int
    ctime_ns: int


@dataclass(frozen=True)
class SourceFile:
    """One checkpoint file: its name in the model folder, where it is, its size and version.

    path is the object URL (s3://bucket/key) the streamer reads, or the local file's path below the
    root with links resolved (for messages and cache keys; never opened). version changes when the
    content may have (modification time, ETag) and is what revisions are made of, the same on every
    server holding the same files. local is set for files under a model root.
    """

    name: str
    path: str
    size: int
    version: str
    local: LocalFile | None = None

    @property
    def fingerprint(self) -> str:
        """version, and for local files their identity too: what keys anything this server keeps of the bytes."""
        local = self.local
        if local is None:
            return self.version
        return f"{self.version}:{local.device}:{local.inode}:{local.ctime_ns}"


@dataclass(frozen=True)
class ModelFiles:
    """The files of one model, and the index's tensor-to-file map when the model has an index.

    weight_map may be shared with other ModelFiles of the same index version: never write to it.
    """

    model: str
    files: tuple[SourceFile, ...]
    weight_map: dict[str, str] | None


def revision(files: Sequence[SourceFile], kinds: Sequence[str] = ()) -> str:
    """A digest of each file's name, size and version (after its kind, where kinds gives one per file), in order.

    Clients keep revisions and compare them with later ones: the same files must always give the
    same string.
    """
    digest = hashlib.sha256()
    for index, f in enumerate(files):
        kind = f"{kinds[index]}\0" if kinds else ""
        digest.update(f"{kind}{f.name}\0{f.size}\0{f.version}\n".encode())
    return digest.hexdigest()[:24]


class Source(Protocol):
    """A place models are stored. Implementations are safe to use from many threads."""

    def claims(self, model: str) -> bool:
        """Whether model ids of this form belong to this source."""
        ...

    def describe(self) -> str: ...

    def reachable(self) -> bool: ...

    def resolve(self, model: str) -> ModelFiles:
        """The files of model, checked to be readable by this server; raises ServerError."""
        ...

    def companion_files(self, model: str) -> tuple[SourceFile, ...]:
        """The files of model named in COMPANION_FILES that exist, checked like its weight files."""
        ...

    def read_range(self, file: SourceFile, start: int, length: int) -> bytes:
        """Up to length bytes of file from start (fewer only at its end); file comes from this source."""
        ...


class LocalSource:
    """Models stored as folders of safetensors files under one root directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(os.path.realpath(root))
        # An absolute link target is inside the root when it names a path under either spelling.
        self._roots = tuple(dict.fromkeys((str(self.root), os.path.abspath(root))))
        self._indexes = _IndexCache(INDEX_CACHE_ENTRIES)

    def claims(self, model: str) -> bool:
        return "://" not in model

    def describe(self) -> str:
        return f"model root {self.root}"

    def read_range(self, file: SourceFile, start: int, length: int) -> bytes:
        """One ranged read, through a descriptor opened beneath the root for it (streams hold OpenFiles instead)."""
        model = file.local.relative.rpartition("/")[0] if file.local is not None else file.path
        with OpenFiles(self, model, {0: file}) as opened:
            return opened.read_range(0, start, length)

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

    def _walk(self) -> _Walk:
        return _Walk(self._roots)

    def _folder(self, model: str) -> _Walk:
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

    def _entry(self, model: str, folder: _Walk, name: str) -> os.stat_result | None:
        """The lstat of name in folder, None if there is none."""
        try:
            return os.stat(name, dir_fd=folder.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise file_error(exc, f"model {model!r}: file {name!r}") from exc

    def _read_index(self, model: str, folder: _Walk) -> dict[str, str] | None:
        what = f"model {model!r}: {INDEX_FILE}"
        if self._entry(model, folder, INDEX_FILE) is None:
            return None
        index = self._file(model, folder, INDEX_FILE, what)
        if index.size > MAX_INDEX_BYTES:
            raise CorruptCheckpoint(f"{what} is larger than {MAX_INDEX_BYTES} bytes")
        weight_map = self._indexes.get(index)
        if weight_map is None:
            with OpenFiles(self, model, {0: index}) as opened:
                raw = opened.read_range(0, 0, index.size)
                opened.check_unchanged(0)
            if len(raw) != index.size:
                raise CheckpointChanged(f"{what} is shorter than when it was listed; it changed on disk")
            weight_map = parse_index(model, raw)
            self._indexes.put(index, weight_map)
        return weight_map

    def _file(self, model: str, folder: _Walk, name: str, what: str) -> SourceFile:
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


class OpenFiles:
    """Some files of one model, open for the reads of one stream (or one manifest, one file read).

    Local files are opened beneath their model root (see the module's docstring), each checked to
    be the file its SourceFile describes, and read only through that descriptor: the Run:ai streamer
    is given path(), /proc/self/fd/N, which opens this very file whatever its name now leads to.
    Objects (S3) are read by URL through their source. check_unchanged compares a descriptor's size
    and times with the listing's at the end of a file's reads; a file replaced by rename meanwhile
    keeps its bytes but loses its name (its change time moves), so that too is a change.

    Ownership: the descriptors, from the constructor (which opens them all or none) until close().
    The reads and checks may run on several threads at once; close comes after the last.
    """

    def __init__(self, source: Source, model: str, files: Mapping[int, SourceFile]) -> None:
        self.model = model
        self._source = source
        self._files = dict(files)
        self._fds: dict[int, int] = {}
        try:
            for index, file in self._files.items():
                if file.local is not None:
                    self._fds[index] = _open_local(model, file)
        except BaseException:
            self.close()
            raise

    def path(self, index: int) -> str:
        """Where the streamer reads the file of index: its descriptor's /proc path, or its URL."""
        fd = self._fds.get(index)
        return self._files[index].path if fd is None else _FD_PATH.format(fd)

    def fd(self, index: int) -> int:
        """The descriptor of the local file of index."""
        return self._fds[index]

    def read_range(self, index: int, start: int, length: int) -> bytes:
        """Up to length bytes of the file of index from start (fewer only at its end)."""
        fd = self._fds.get(index)
        if fd is None:
            return self._source.read_range(self._files[index], start, length)
        parts: list[bytes] = []
        done = 0
        while done < length:
            try:
                data = os.pread(fd, length - done, start + done)
            except OSError as exc:
                raise file_error(exc, self._what(index), listed=True) from exc
            if not data:
                break
            parts.append(data)
            done += len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def check_unchanged(self, index: int) -> None:
        """Raise CheckpointChanged if the local file of index is no longer as it was listed."""
        fd = self._fds.get(index)
        if fd is not None:
            _check_identity(self.model, self._files[index], os.fstat(fd))

    def check_all_unchanged(self) -> None:
        for index in self._fds:
            self.check_unchanged(index)

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _what(self, index: int) -> str:
        return f"model {self.model!r}: file {self._files[index].name!r}"


def file_error(exc: OSError, what: str, *, listed: bool = False) -> ServerError:
    """The ServerError an OSError of file access under a model root stands for: the one place errnos are mapped.

    what names the model and file (never a server path). listed: the file was listed before (by a
    manifest or a file listing), so one that is gone now changed on disk rather than never existed.
    """
    code = exc.errno
    reason = exc.strerror or type(exc).__name__
    if code in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
        if listed:
            return CheckpointChanged(f"{what} is gone since it was listed ({reason}); it changed on disk")
        return ModelNotFound(f"{what} not found" if code == errno.ENOENT else f"{what} not found: {reason}")
    if code == errno.ENAMETOOLONG:
        return InvalidModelId(f"{what}: a name in it is longer than the file system allows")
    if code in (errno.EACCES, errno.EPERM):
        return AccessDenied(f"{what}: the server may not read it ({reason}); refused")
    if code in (errno.EISDIR, errno.ENXIO, errno.ENODEV):
        return CorruptCheckpoint(f"{what} is not a regular file")
    if code == errno.EIO:
        return CorruptCheckpoint(f"{what}: the storage failed to read it ({reason})")
    # EMFILE, ENFILE, ENOMEM, ESTALE and the like: the server or its storage, not the checkpoint.
    return StorageUnavailable(f"{what}: {reason}; try again")


class _Walk:
    """A position beneath a model root, reached one path component at a time without following a link.

    Each directory is opened with O_NOFOLLOW relative to the one before, starting from the root's
    descriptor; a symlink is read and its target walked the same way, from the link's directory or,
    for an absolute target under the root, from the root; ".." returns to the directory the walk
    came from and never goes above the root. However the tree changes meanwhile, the walk cannot
    leave the root: a change can only make it fail.

    Ownership: the directory descriptors, until close(). Use from one thread.
    """

    def __init__(self, roots: tuple[str, ...]) -> None:
        self._roots = roots
        self._root = os.open(roots[0], _DIRECTORY)
        self._stack: list[int] = []
        self._names: list[str] = []

    @property
    def fd(self) -> int:
        """The directory the walk stands in."""
        return self._stack[-1] if self._stack else self._root

    @property
    def relative(self) -> str:
        """The path of that directory below the root, links resolved."""
        return "/".join(self._names)

    def follow(self, path: str, what: str) -> tuple[str, os.stat_result] | None:
        """Walk path (relative) from here, following links beneath the root.

        If it leads to a directory, the walk stands in it and this returns None; otherwise it stands in
        the entry's folder and this returns the entry's name and lstat (never a link). Raises
        AccessDenied (naming what) for a path or link that leaves the root, OSError for the rest.
        """
        pending = path.split("/")[::-1]
        links = 0
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            if name == "..":
                if not self._stack:
                    raise AccessDenied(f"{what} resolves outside the model root; refused")
                os.close(self._stack.pop())
                self._names.pop()
                continue
            entry = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            if stat.S_ISLNK(entry.st_mode):
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                target = os.readlink(name, dir_fd=self.fd)
                if target.startswith("/"):
                    below = self._below_root(target)
                    if below is None:
                        raise AccessDenied(f"{what} resolves outside the model root; refused")
                    self._to_root()
                    target = below
                pending.extend(target.split("/")[::-1])
                continue
            if stat.S_ISDIR(entry.st_mode):
                if len(self._stack) >= _MAX_DEPTH:
                    raise OSError(errno.ELOOP, f"more than {_MAX_DEPTH} folders deep")
                self._stack.append(os.open(name, _DIRECTORY | os.O_NOFOLLOW, dir_fd=self.fd))
                self._names.append(name)
                continue
            if any(part not in ("", ".") for part in pending):
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            return name, entry
        return None

    def close(self) -> None:
        self._to_root()
        os.close(self._root)

    def __enter__(self) -> _Walk:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _below_root(self, target: str) -> str | None:
        for root in self._roots:
            prefix = root.rstrip("/") + "/"
            if target == root or target.startswith(prefix):
                return target[len(prefix) :]
        return None

    def _to_root(self) -> None:
        stack, self._stack, self._names = self._stack, [], []
        for fd in stack:
            os.close(fd)


def _open_local(model: str, file: SourceFile) -> int:
    """A descriptor of file, opened beneath its root and checked to be the regular file that was listed."""
    local = file.local
    assert local is not None
    what = f"model {model!r}: file {file.name!r}"
    try:
        with _Walk(local.roots) as walk:
            leaf = walk.follow(local.relative, what)
            if leaf is None or not stat.S_ISREG(leaf[1].st_mode):
                raise CheckpointChanged(f"{what} is no longer a regular file; it changed on disk")
            fd = os.open(leaf[0], _FILE, dir_fd=walk.fd)
    except OSError as exc:
        raise file_error(exc, what, listed=True) from exc
    try:
        opened = os.fstat(fd)
        if not stat.S_ISREG(opened.st_mode):
            raise CheckpointChanged(f"{what} is no longer a regular file; it changed on disk")
        os.set_blocking(fd, True)
        _check_identity(model, file, opened)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_identity(model: str, file: SourceFile, now: os.stat_result) -> None:
    local = file.local
    assert local is not None
    what = f"model {model!r}: {file.name}"
    if (now.st_dev, now.st_ino) != (local.device, local.inode):
        raise CheckpointChanged(f"{what} is another file than the one listed; it changed on disk")
    if now.st_size != file.size:
        raise CheckpointChanged(
            f"{what} is {now.st_size} bytes, not the {file.size} bytes it had when it was listed; it changed on disk"
        )
    if (now.st_mtime_ns, now.st_ctime_ns) != (local.mtime_ns, local.ctime_ns):
        raise CheckpointChanged(f"{what} was written, renamed or replaced since it was listed; it changed on disk")


class _IndexCache:
    """Parsed weight maps by index file, the latest version of each; least recently used go past a bound.

    Concurrency: every method may be called from any thread. The maps are shared: never written.
    """

    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries
        self._lock = threading.Lock()
        self._maps: OrderedDict[str, tuple[str, dict[str, str]]] = OrderedDict()
        self._entries = 0

    def get(self, index: SourceFile) -> dict[str, str] | None:
        with self._lock:
            kept = self._maps.get(index.path)
            if kept is None or kept[0] != index.fingerprint:
                return None
            self._maps.move_to_end(index.path)
            return kept[1]

    def put(self, index: SourceFile, weight_map: dict[str, str]) -> None:
        with self._lock:
            old = self._maps.pop(index.path, None)
            if old is not None:
                self._entries -= len(old[1])
            self._maps[index.path] = (index.fingerprint, weight_map)
            self._entries += len(weight_map)
            while self._entries > self._max_entries and len(self._maps) > 1:
                _, (_, dropped) = self._maps.popitem(last=False)
                self._entries -= len(dropped)


def check_model_id(model: str) -> None:
    """Raise InvalidModelId unless model is a relative path of plain names."""
    if not model:
        raise InvalidModelId("model id is empty")
    if len(model) > MAX_MODEL_ID_CHARS:
        raise InvalidModelId(f"model id is longer than {MAX_MODEL_ID_CHARS} characters")
    if not _MODEL_ID.fullmatch(model):
        raise InvalidModelId(
            f"invalid model id {model[:80]!r}: use a relative name of letters, digits, '.', '_', '-' and '/', "
            "with no '..' and no leading '/'"
        )


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ending in "/"


def parse_s3_model_id(model: str) -> S3Location:
    """Bucket and folder prefix of an `s3://bucket/prefix` model id."""
    if not model.startswith(S3_SCHEME):
        raise InvalidModelId(f"model {model[:200]!r} is not an s3:// id")
    bucket, _, prefix = model[len(S3_SCHEME) :].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise InvalidModelId(f"model {model[:200]!r}: {bucket[:80]!r} is not a valid bucket name")
    if len(prefix) > MAX_PREFIX_CHARS or any(ord(c) < 0x20 for c in prefix):
        raise InvalidModelId(f"model {model[:200]!r}: invalid key prefix")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return S3Location(bucket, prefix)


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
