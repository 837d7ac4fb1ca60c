"""What a source of checkpoints is: the Source protocol, the files it lists and a model's revision.

A Source resolves a model id to its safetensors files (ModelFiles) and lists the companion files
(config, tokenizer, index) an engine needs next to them: only those named in COMPANION_FILES, never
anything else in the folder. The sources are local.LocalSource (a model root), s3.S3Source (a
bucket), upstream.UpstreamSource (another weightstream server) and tiers.TieredSource (either of the
last two through a disk cache). Callers ask a source what they need to know (public_name,
read_units) rather than test its type.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from weightstream_server.storage.index import INDEX_FILE

if TYPE_CHECKING:
    import torch

    from weightstream_server.storage.reads import ReadPlan


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

    def public_name(self) -> str:
        """What a caller without a token may be told this source is: its kind or public id, never an address or path."""
        ...

    def read_range(self, file: SourceFile, start: int, length: int) -> bytes:
        """Up to length bytes of file from start (fewer only at its end); file comes from this source."""
        ...

    def read_units(self, files: Sequence[SourceFile], plan: ReadPlan) -> Iterator[tuple[int, int, torch.Tensor]] | None:
        """The read units of plan as this source reads them itself, or None where the streamer reads the files by path.

        Items are (index in plan.files, index of the unit, its bytes as flat uint8), each valid
        until the next is taken.
        """
        ...
