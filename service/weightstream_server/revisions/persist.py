"""Published revisions written to disk (--publish-dir) or S3 (--publish-s3-prefix): each complete
revision as safetensors files.

A revision R of model M is written to PUBLISH_DIR/M/R/ (one file per part, model-0000i-of-0000n
.safetensors), into a hidden folder beside it first, each file flushed to disk, then renamed into
place: a reader of PUBLISH_DIR never sees a revision half written, and a server started with
--model-root PUBLISH_DIR serves it as the model "M/R". A revision already on disk under that name is
replaced. Writes run on a thread of their own, after the revision is current; a failure is logged
and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file

from weightstream_server.revisions.published_source import PublishedSource
from weightstream_server.revisions.store import Revision
from weightstream_server.storage.index import INDEX_FILE
from weightstream_server.storage.model_ids import S3_SCHEME, ObjectLocation
from weightstream_server.storage.s3 import translated

logger = logging.getLogger(__name__)


def write_in_background(directory: Path, revision: Revision) -> threading.Thread:
    thread = threading.Thread(
        target=_write_logged, args=(directory, revision), name="weightstream-persist", daemon=True
    )
    thread.start()
    return thread


def _write_logged(directory: Path, revision: Revision) -> None:
    started = time.monotonic()
    try:
        final = write_revision(directory, revision)
    except (OSError, ValueError, RuntimeError) as exc:
        logger.error(
            "model %r: revision %s could not be written to %s: %s", revision.model, revision.id, directory, exc
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


def write_revision(directory: Path, revision: Revision) -> Path:
    """Write revision under directory/<model>/<revision>/, atomically; the folder written."""
    manifest = revision.manifest
    source = cast(PublishedSource, manifest.source)
    model_dir = directory / manifest.model
    model_dir.mkdir(parents=True, exist_ok=True)
    final = model_dir / revision.id
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
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
        _fsync(model_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


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
