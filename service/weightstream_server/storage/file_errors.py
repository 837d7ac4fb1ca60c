"""The one place where an OSError of file access under a model root becomes a ServerError."""

from __future__ import annotations

import errno

from weightstream_server.errors import (
    AccessDenied,
    CheckpointChanged,
    CorruptCheckpoint,
    InvalidModelId,
    ModelNotFound,
    ServerError,
    StorageUnavailable,
)


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
