"""Published revisions written to disk (--publish-dir): each complete revision as safetensors files.

A revision R of model M is written to PUBLISH_DIR/M/R/ (one file per part, model-0000i-of-0000n
.safetensors), into a hidden folder beside it first, each file flushed to disk, then renamed into
place: a reader of PUBLISH_DIR never sees a revision half written, and a server started with
--model-root PUBLISH_DIR serves it as the model "M/R". A revision already on disk under that name is
replaced. Writes run on a thread of their own, after the revision is current; a failure is logged
and leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors.torch import save_file

from weightstream_server.revisions.store import Revision

if TYPE_CHECKING:
    from weightstream_server.revisions.published import PublishedSource

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
    source = cast("PublishedSource", manifest.source)
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
