"""Published revisions written to disk (--publish-dir) or S3 (--publish-s3-prefix): each complete
revision as safetensors files.

A revision R of model M is written to PUBLISH_DIR/M/R/ (one file per part, model-0000i-of-0000n
.safetensors), into a hidden folder beside it first, each file flushed to disk, then renamed into
place: a reader of PUBLISH_DIR never sees a revision half written, and a server started with
--model-root PUBLISH_DIR serves it as the model "M/R". A revision folder that exists is never
overwritten. PUBLISH_DIR/M/.weightstream-revisions.json lists the revisions written there, oldest
first, and the model's current one; revisions this server no longer keeps (--keep-revisions) are
removed from the folder as each new one is written (renamed aside, then deleted: a reader that has
their files open keeps reading them). A restarted server reads that list back (PublishDir.recover):
the model's kept revisions and which one is current, and removes what a crash left half written.

Every path is made from a model id and a revision name checked as a publisher's are, then resolved
and checked to lie inside PUBLISH_DIR before anything is created or removed there.

Writes run on a thread of their own, after the revision is current, one model folder at a time; a
failure is logged and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file

from weightstream_server.errors import AccessDenied, ServerError
from weightstream_server.revisions.published_source import PublishedSource
from weightstream_server.revisions.store import Revision
from weightstream_server.storage.index import INDEX_FILE
from weightstream_server.storage.model_ids import S3_SCHEME, ObjectLocation, check_model_id, check_revision_name
from weightstream_server.storage.s3 import translated

logger = logging.getLogger(__name__)

# The list of a model's revisions written under PUBLISH_DIR/MODEL/, and its current one.
REVISIONS_FILE = ".weightstream-revisions.json"
# Folders a write (partial) or a removal (removing) leaves beside a model's revisions while it runs.
_STAGING = re.compile(r"\.(?P<revision>.+)\.(?P<kind>partial|removing)-[0-9a-f]{12}")
# The most revisions a model's list names (what --keep-revisions may keep is far below).
MAX_LISTED = 1024


class OutsidePublishDir(AccessDenied):
    """A path made from a model id and a revision name would lie outside --publish-dir."""


@dataclass(frozen=True)
class Persisted:
    """A model's revisions found in --publish-dir at start-up, oldest first, and its current one."""

    model: str
    revisions: list[str]
    current: str


class PublishDir:
    """The folder --publish-dir names: published revisions written there, pruned, and found again.

    Thread-safe: writes of one server are made one at a time.
    """

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root.resolve()
        self._lock = threading.Lock()
        # The revision of each model waiting to be written (the newest only), and the one writer thread.
        self._due: dict[str, tuple[Revision, Callable[[], tuple[list[str], str]]]] = {}
        self._due_lock = threading.Lock()
        self._writer: threading.Thread | None = None

    def model_dir(self, model: str) -> Path:
        """PUBLISH_DIR/model, checked to lie inside it (model checked as a publisher's model id)."""
        check_model_id(model)
        return self._inside(self.root / model, f"model {model!r}")

    def revision_dir(self, model: str, revision: str) -> Path:
        check_revision_name(model, revision, "the publish dir")
        return self._inside(self.model_dir(model) / revision, f"revision {revision!r} of model {model!r}")

    def holds(self, model: str, revision: str) -> bool:
        """Whether a folder of revision of model exists here (a name that may not be published again)."""
        try:
            return self.revision_dir(model, revision).exists()
        except ServerError:
            return False

    def _inside(self, path: Path, what: str) -> Path:
        # No link anywhere below the root: a link could make one model's folder another's.
        for parent in [path, *path.parents]:
            if parent == self.root or len(parent.parts) <= len(self.root.parts):
                break
            if parent.is_symlink():
                raise OutsidePublishDir(f"{what}: {parent} is a link; the publish dir holds no links")
        resolved = path.resolve()
        if resolved != self.root and not resolved.is_relative_to(self.root):
            raise OutsidePublishDir(f"{what}: {resolved} is outside the publish dir {self.root}")
        return resolved

    def write_in_background(self, revision: Revision, kept: Callable[[], tuple[list[str], str]]) -> None:
        """write() on the writer thread; a failure is logged. kept gives the model's kept revisions and
        its current one when the write is done (what the folder keeps).

        One thread writes, one revision at a time; a model's revision still waiting when a newer one
        comes is not written (the newer one is), so revisions published faster than the disk takes
        them hold neither memory nor threads beyond the newest of each model.
        """
        with self._due_lock:
            replaced = self._due.get(revision.model)
            self._due[revision.model] = (revision, kept)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_due, name="weightstream-persist", daemon=True)
                self._writer.start()
        if replaced is not None:
            logger.info(
                "model %r: revision %s is not written to %s: revision %s came before it was",
                revision.model,
                replaced[0].id,
                self.root,
                revision.id,
            )

    def wait_written(self, timeout: float) -> bool:
        """Wait up to timeout s for the revisions due to be written (a stopping server's last
        publishes); whether none is left."""
        deadline = time.monotonic() + timeout
        while True:
            with self._due_lock:
                writer = self._writer
            if writer is None:
                return True
            writer.join(max(0.0, deadline - time.monotonic()))
            if writer.is_alive():
                return False

    def _write_due(self) -> None:
        while True:
            with self._due_lock:
                if not self._due:
                    self._writer = None  # the next write starts another
                    return
                model = next(iter(self._due))
                revision, kept = self._due.pop(model)
            self._write_logged(revision, kept)

    def _write_logged(self, revision: Revision, kept: Callable[[], tuple[list[str], str]]) -> None:
        started = time.monotonic()
        try:
            final = self.write(revision, kept)
        except (OSError, ValueError, RuntimeError, ServerError) as exc:
            logger.error(
                "model %r: revision %s could not be written to %s: %s", revision.model, revision.id, self.root, exc
            )
            return
        logger.info(
            "model %r: revision %s written to %s (%d bytes, %.3f s)",
            revision.model,
            revision.id,
            final,
            revision.manifest.total_bytes,
            time.monotonic() - started,
        )

    def write(self, revision: Revision, kept: Callable[[], tuple[list[str], str]]) -> Path:
        """Write revision under PUBLISH_DIR/<model>/<revision>/, atomically, then remove the revisions
        written before that the model no longer keeps; the folder written. FileExistsError if that
        revision's folder exists (it is never overwritten)."""
        with self._lock:
            if revision.id not in kept()[0]:
                raise FileExistsError(f"revision {revision.id} is no longer kept; not written")
            model_dir = self.model_dir(revision.model)
            final = self.revision_dir(revision.model, revision.id)
            if self._in_a_revision(revision.model):
                raise OutsidePublishDir(
                    f"model {revision.model!r}: its folder would lie inside a revision folder of another model"
                )
            if final.exists():
                raise FileExistsError(f"{final} exists; a revision folder is never overwritten")
            model_dir.mkdir(parents=True, exist_ok=True)
            _write_files(revision, model_dir, final)
            listed = [r for r in self._listed(revision.model) if r != revision.id] + [revision.id]
            keep, current = kept()
            for old in listed[:-1]:
                if old not in keep:
                    self._remove(revision.model, old)
            listed = [r for r in listed if r in keep or r == revision.id][-MAX_LISTED:]
            self._save_list(revision.model, listed, current if current in listed else revision.id)
            return final

    def _in_a_revision(self, model: str) -> bool:
        """Whether a folder of model's id would lie inside a listed revision of an ancestor model ("m/x"
        inside revision x of model "m")."""
        parts = model.split("/")
        for cut in range(1, len(parts)):
            ancestor, below = "/".join(parts[:cut]), parts[cut]
            if below in self._listed(ancestor):
                return True
        return False

    def _listed(self, model: str) -> list[str]:
        found = self._read_list(model)
        return found.revisions if found is not None else []

    def _read_list(self, model: str) -> Persisted | None:
        path = self.model_dir(model) / REVISIONS_FILE
        try:
            data = json.loads(path.read_text())
            revisions = [str(r) for r in data["revisions"]][-MAX_LISTED:]
            current = str(data["current"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("%s is unreadable (%s); its revisions are not known", path, exc)
            return None
        return Persisted(model, revisions, current)

    def _save_list(self, model: str, revisions: list[str], current: str) -> None:
        model_dir = self.model_dir(model)
        staging = model_dir / f"{REVISIONS_FILE}.{uuid.uuid4().hex[:12]}"
        staging.write_text(json.dumps({"current": current, "revisions": revisions}))
        _fsync(staging)
        os.replace(staging, model_dir / REVISIONS_FILE)
        _fsync(model_dir)

    def _remove(self, model: str, revision: str) -> None:
        """Remove a revision's folder: renamed aside at once (atomic), then deleted."""
        try:
            folder = self.revision_dir(model, revision)
        except ServerError as exc:
            logger.warning("model %r: listed revision %r is not removed: %s", model, revision[:200], exc)
            return
        if not folder.is_dir():
            return
        if next(folder.rglob(REVISIONS_FILE), None) is not None:
            logger.warning("model %r: %s holds another model's revisions; it is not removed", model, folder)
            return
        aside = folder.parent / f".{revision}.removing-{uuid.uuid4().hex[:12]}"
        os.rename(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)
        logger.info("model %r: revision %s removed from %s (no longer kept)", model, revision, folder.parent)

    def recover(self) -> list[Persisted]:
        """Each model's revisions written here before, as listed (those whose folders exist, names checked),
        after removing the folders a write or removal that did not finish left (logged)."""
        found: list[Persisted] = []
        for folder, names in self._model_folders():
            for name in names:
                match = _STAGING.fullmatch(name)
                if match is not None:
                    logger.warning("removing %s, left by a write or removal that did not finish", folder / name)
                    shutil.rmtree(folder / name, ignore_errors=True)
            if REVISIONS_FILE not in names:
                continue
            model = folder.relative_to(self.root).as_posix()
            try:
                listed = self._read_list(model)
            except ServerError as exc:
                logger.warning("%s: not a model's folder: %s", folder, exc)
                continue
            if listed is None:
                continue
            revisions = []
            for revision in listed.revisions:
                try:
                    if self.revision_dir(model, revision).is_dir():
                        revisions.append(revision)
                except ServerError as exc:
                    logger.warning("%s: revision %r is skipped: %s", folder / REVISIONS_FILE, revision[:200], exc)
            if revisions:
                current = listed.current if listed.current in revisions else revisions[-1]
                found.append(Persisted(model, revisions, current))
        return found

    def _model_folders(self) -> Iterator[tuple[Path, list[str]]]:
        """Each folder under the root that is not hidden, with the names in it (links not followed)."""
        for folder, dirs, files in os.walk(self.root, followlinks=False):
            names = [*dirs, *files]
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            yield Path(folder), names


def load_revision_files(folder: Path) -> list[Path]:
    """The safetensors files of a revision's folder, in part order."""
    return sorted(p for p in folder.glob("model-*-of-*.safetensors") if p.is_file() and not p.is_symlink())


def _write_files(revision: Revision, model_dir: Path, final: Path) -> None:
    manifest = revision.manifest
    source = cast(PublishedSource, manifest.source)
    staging = model_dir / f".{revision.id}.partial-{uuid.uuid4().hex[:12]}"
    staging.mkdir()
    try:
        parts = len(manifest.files)
        for index in range(parts):
            tensors = {
                t.name: _view(source.part_buffer(index), t.file_offset, t.nbytes, t.dtype.torch, t.shape)
                for t in manifest.tensors
                if t.file_index == index
            }
            path = staging / f"model-{index + 1:05d}-of-{parts:05d}.safetensors"
            save_file(tensors, str(path), metadata={"revision": revision.id, "model": manifest.model})
            _fsync(path)
        _fsync(staging)
        os.rename(staging, final)  # a folder that appeared meanwhile: OSError, never replaced
        _fsync(model_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _view(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return buffer[offset : offset + nbytes].view(dtype).view(shape)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def upload_in_background(client: Any, location: ObjectLocation, revision: Revision) -> threading.Thread:
    """upload_revision on a thread of its own; a failure is logged (and what was uploaded removed)."""
    thread = threading.Thread(
        target=_upload_logged, args=(client, location, revision), name="weightstream-upload", daemon=True
    )
    thread.start()
    return thread


def _upload_logged(client: Any, location: ObjectLocation, revision: Revision) -> None:
    started = time.monotonic()
    try:
        where = upload_revision(client, location, revision)
    except Exception as exc:
        logger.error("model %r: revision %s could not be uploaded: %s", revision.model, revision.id, exc)
        return
    logger.info(
        "model %r: revision %s uploaded to %s (%d bytes, %.3f s)",
        revision.model,
        revision.id,
        where,
        revision.manifest.total_bytes,
        time.monotonic() - started,
    )


def upload_revision(client: Any, location: ObjectLocation, revision: Revision) -> str:
    """Upload revision under location's prefix as MODEL/REVISION/ (model id s3://BUCKET/PREFIX/MODEL/REVISION);
    the model id uploaded.

    S3 has no rename, so the index goes first: until every file it names is there, a reader of the
    prefix gets an error naming the file missing (CorruptCheckpoint), never part of the revision.
    Each file is one object, whole or absent. An upload that fails removes what it uploaded.
    """
    manifest = revision.manifest
    source = cast(PublishedSource, manifest.source)
    base = f"{location.prefix}{manifest.model}/{revision.id}/"
    used = sorted({t.file_index for t in manifest.tensors})
    names = {index: f"model-{n + 1:05d}-of-{len(used):05d}.safetensors" for n, index in enumerate(used)}
    index = {
        "metadata": {"total_size": manifest.total_bytes, "revision": revision.id},
        "weight_map": {t.name: names[t.file_index] for t in manifest.tensors},
    }
    uploaded: list[str] = []
    with translated(location.bucket, base):
        try:
            key = base + INDEX_FILE
            client.put_object(Bucket=location.bucket, Key=key, Body=json.dumps(index).encode())
            uploaded.append(key)
            with tempfile.TemporaryDirectory(prefix="weightstream-upload-") as staging:
                for file_index, name in names.items():
                    tensors = {
                        t.name: _view(source.part_buffer(file_index), t.file_offset, t.nbytes, t.dtype.torch, t.shape)
                        for t in manifest.tensors
                        if t.file_index == file_index
                    }
                    path = Path(staging) / name
                    save_file(tensors, str(path), metadata={"revision": revision.id, "model": manifest.model})
                    client.upload_file(str(path), location.bucket, base + name)
                    uploaded.append(base + name)
                    path.unlink()
        except BaseException:
            for key in uploaded:
                with contextlib.suppress(Exception):
                    client.delete_object(Bucket=location.bucket, Key=key)
            raise
    return f"{S3_SCHEME}{location.bucket}/{base.rstrip('/')}"
