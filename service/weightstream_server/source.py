"""Where checkpoints live: a Source resolves a model id to its safetensors files and reads their bytes.

Next to its weights a model folder may hold companion files (config, tokenizer, index) that an
engine needs; a source lists only those named in COMPANION_FILES, never anything else in the folder.

LocalSource serves folders under a model root. It never reads outside that root: ids that are
absolute or contain "..", and symlinks (of the model folder or of any file) that resolve outside
the root, are refused before any file is opened.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from weightstream_server.errors import AccessDenied, CorruptCheckpoint, InvalidModelId, ModelNotFound

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
# One or more path components of letters, digits, ".", "_" and "-", none starting with a dot:
# this rules out "..", hidden folders, absolute paths and backslashes in one place.
_MODEL_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")
S3_SCHEME = "s3://"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
MAX_PREFIX_CHARS = 1024
_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*\.safetensors")


@dataclass(frozen=True)
class SourceFile:
    """One checkpoint file: its name in the model folder, where the streamer reads it, size, version.

    path is a local path or an object URL (s3://bucket/key); version changes when the content may
    have (modification time, ETag).
    """

    name: str
    path: str
    size: int
    version: str


@dataclass(frozen=True)
class ModelFiles:
    """The files of one model, and the index's tensor-to-file map when the model has an index."""

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

    def claims(self, model: str) -> bool:
        return "://" not in model

    def describe(self) -> str:
        return f"model root {self.root}"

    def read_range(self, file: SourceFile, start: int, length: int) -> bytes:
        with open(file.path, "rb") as f:
            f.seek(start)
            return f.read(length)

    def reachable(self) -> bool:
        return self.root.is_dir() and os.access(self.root, os.R_OK | os.X_OK)

    def resolve(self, model: str) -> ModelFiles:
        """The files of model, checked to lie inside the root; raises before reading any tensor."""
        folder = self._folder(model)
        weight_map = self._read_index(model, folder)
        if weight_map is not None:
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in folder.glob("*.safetensors"))
        if not names:
            raise ModelNotFound(f"model {model!r} has no *.safetensors files")
        return ModelFiles(model, tuple(self._file(model, folder, name) for name in names), weight_map)

    def companion_files(self, model: str) -> tuple[SourceFile, ...]:
        folder = self._folder(model)
        # lexists: a dangling or escaping symlink under an allowed name is refused, not skipped.
        present = sorted(name for name in COMPANION_FILES if os.path.lexists(folder / name))
        return tuple(self._file(model, folder, name) for name in present)

    def _folder(self, model: str) -> Path:
        check_model_id(model)
        folder = Path(os.path.realpath(self.root / model))
        if not _inside(folder, self.root):
            raise AccessDenied(f"model {model!r} resolves outside the model root; refused")
        if not folder.is_dir():
            raise ModelNotFound(f"model {model!r} not found")
        return folder

    def _read_index(self, model: str, folder: Path) -> dict[str, str] | None:
        index_path = folder / INDEX_FILE
        if not index_path.exists():
            return None
        resolved = Path(os.path.realpath(index_path))
        if not _inside(resolved, self.root):
            raise AccessDenied(f"model {model!r}: {INDEX_FILE} resolves outside the model root; refused")
        if resolved.stat().st_size > MAX_INDEX_BYTES:
            raise CorruptCheckpoint(f"model {model!r}: {INDEX_FILE} is larger than {MAX_INDEX_BYTES} bytes")
        return parse_index(model, resolved.read_bytes())

    def _file(self, model: str, folder: Path, name: str) -> SourceFile:
        path = Path(os.path.realpath(folder / name))
        if not _inside(path, self.root):
            raise AccessDenied(f"model {model!r}: file {name!r} resolves outside the model root; refused")
        try:
            stat = path.stat()
        except FileNotFoundError as exc:
            raise ModelNotFound(f"model {model!r}: file {name!r} not found") from exc
        if not path.is_file():
            raise CorruptCheckpoint(f"model {model!r}: {name!r} is not a regular file")
        return SourceFile(name, str(path), stat.st_size, str(stat.st_mtime_ns))


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


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


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
    """The weight_map of a model.safetensors.index.json, checked to name only plain *.safetensors files."""
    try:
        index = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"model {model!r}: {INDEX_FILE} is not valid JSON: {exc}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CorruptCheckpoint(f"model {model!r}: {INDEX_FILE} has no valid weight_map")
    for file_name in set(weight_map.values()):
        if not _FILE_NAME.fullmatch(file_name):
            raise CorruptCheckpoint(
                f"model {model!r}: {INDEX_FILE} names file {file_name[:80]!r}, which is not a plain "
                "*.safetensors name in the model folder"
            )
    return weight_map
