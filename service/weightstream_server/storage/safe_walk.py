"""A walk beneath a model root that cannot leave it, however the tree changes meanwhile.

Every path under the root is walked one component at a time from a descriptor of the root, each
directory opened with O_NOFOLLOW relative to the one before; a symlink met on the way is read and
its target walked the same way, and a target that leaves the root (an absolute path elsewhere, or
".." above the root) is refused (AccessDenied). Links that stay inside the root are followed.
"""

from __future__ import annotations

import errno
import os
import stat
from types import TracebackType

from weightstream_server.errors import AccessDenied

# Links followed in one walk before it is a loop (the kernel's own bound), and folders a walk may
# stand in at once (it holds a descriptor of each): model folders are a few levels deep.
MAX_LINKS = 40
MAX_DEPTH = 64
DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: the walk only opens what lstat called a regular file, but a FIFO swapped in between
# must not block the open; it is then refused by fstat.
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class SafeWalk:
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
        self._root = os.open(roots[0], DIRECTORY_FLAGS)
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
                if links > MAX_LINKS:
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
                if len(self._stack) >= MAX_DEPTH:
                    raise OSError(errno.ELOOP, f"more than {MAX_DEPTH} folders deep")
                self._stack.append(os.open(name, DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd))
                self._names.append(name)
                continue
            if any(part not in ("", ".") for part in pending):
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            return name, entry
        return None

    def close(self) -> None:
        self._to_root()
        os.close(self._root)

    def __enter__(self) -> SafeWalk:
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
