"""Walking and removing trees an untrusted command left behind, without recursion.

A sandboxed command owns its working directory and may leave anything there: a
tree 1,500 folders deep (``mkdir -p "$(printf 'd/%.0s' $(seq 1500))"``), one
deeper than ``PATH_MAX``, a million files, folders of mode 000, files marked
immutable, symlinks to anywhere. ``os.walk`` and ``shutil.rmtree`` recurse
(Python 3.11: ``RecursionError`` near 1,000 levels, and ``rmtree(...,
ignore_errors=True)`` then leaves the folder), so the parent uses these
instead:

* :func:`walk` is ``os.walk`` (top-down, never following links) with an explicit
  stack and sorted names; a folder it cannot list (too deep a path, no
  permission) is skipped, never raised.
* :func:`remove_tree` removes a tree through folder descriptors (``openat`` /
  ``unlinkat``, so no path grows past ``PATH_MAX``), one descriptor open at a
  time (``..`` leads back up), opening up folders of mode 000 and clearing the
  immutable and append-only flags where a removal is refused.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

#: <linux/fs.h>: FS_IOC_GETFLAGS / FS_IOC_SETFLAGS (the kernel reads an int), FS_IMMUTABLE_FL, FS_APPEND_FL.
_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS = 0x80086601, 0x40086602
_FS_NO_REMOVE = 0x00000010 | 0x00000020
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def walk(root: str | Path) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(root, followlinks=False)`` without recursion: ``(dirpath, dirnames, filenames)``, names sorted.

    ``dirnames`` may be pruned in place, as with ``os.walk``. Symlinks (to folders too) are listed among the
    file names. A folder that cannot be listed is skipped.
    """
    stack = [os.fspath(root)]
    while stack:
        top = stack.pop()
        try:
            dirs, files = _scan(top)
        except OSError:
            continue
        dirs.sort()
        files.sort()
        yield top, dirs, files
        stack.extend(os.path.join(top, d) for d in reversed(dirs))


def _clear_flags(name: str, dir_fd: int) -> bool:
    """Clear the immutable and append-only flags of ``name`` (a file or folder in ``dir_fd``); True if any were set."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        buf = bytearray(8)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf)
        (flags,) = struct.unpack_from("i", buf)
        if not flags & _FS_NO_REMOVE:
            return False
        struct.pack_into("i", buf, 0, flags & ~_FS_NO_REMOVE)
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _open_dir(name: str, dir_fd: int) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:  # mode 000 (we are not root, or root without CAP_DAC_OVERRIDE)
        os.chmod(name, 0o700, dir_fd=dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _remove(name: str, dir_fd: int, *, is_dir: bool) -> None:
    remove = os.rmdir if is_dir else os.unlink
    try:
        remove(name, dir_fd=dir_fd)
    except PermissionError:
        # Immutable or append-only (the entry, or the folder it is in), or a folder we may not write.
        _clear_flags(name, dir_fd)
        _clear_flags(".", dir_fd)
        try:
            os.chmod(".", 0o700, dir_fd=dir_fd)
        except OSError:
            pass
        remove(name, dir_fd=dir_fd)


def _scan(folder: str | int) -> tuple[list[str], list[str]]:
    """A folder's (path or descriptor) entries split into sub-folders and the rest (symlinks never followed)."""
    dirs: list[str] = []
    others: list[str] = []
    with os.scandir(folder) as it:
        for entry in it:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            (dirs if is_dir else others).append(entry.name)
    return dirs, others


def remove_tree(path: str | Path) -> None:
    """Remove ``path`` and everything under it (see the module); a missing path is no error.

    Raises:
        OSError: something could not be removed (the first failure; the rest was still tried).
    """
    path = Path(os.path.abspath(path))
    try:
        top = os.lstat(path)
    except FileNotFoundError:
        return
    parent_fd = os.open(path.parent, _DIR_FLAGS & ~os.O_NOFOLLOW)
    first_error: OSError | None = None
    try:
        if not stat.S_ISDIR(top.st_mode):
            _remove(path.name, parent_fd, is_dir=False)
            return
        fd = _open_dir(path.name, parent_fd)
        # levels[i]: (folder name, identity, sub-folders still to visit; None until listed)
        levels: list[tuple[str, tuple[int, int], list[str] | None]] = [(path.name, (top.st_dev, top.st_ino), None)]
        while levels:
            name, ident, pending = levels[-1]
            if pending is None:
                try:
                    pending, others = _scan(fd)
                except OSError as exc:
                    first_error, pending, others = first_error or exc, [], []
                for other in others:
                    try:
                        _remove(other, fd, is_dir=False)
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        first_error = first_error or exc
                levels[-1] = (name, ident, pending)
            if pending:
                sub = pending.pop()
                try:
                    child = _open_dir(sub, fd)
                except OSError as exc:
                    if exc.errno != errno.ENOENT:
                        first_error = first_error or exc
                    continue
                st = os.fstat(child)
                os.close(fd)
                fd = child
                levels.append((sub, (st.st_dev, st.st_ino), None))
                continue
            levels.pop()
            if not levels:
                os.close(fd)
                fd = -1
                try:
                    _remove(name, parent_fd, is_dir=True)
                except OSError as exc:
                    first_error = first_error or exc
                break
            up = os.open("..", _DIR_FLAGS & ~os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = up
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != levels[-1][1]:  # the tree moved under us: stop rather than guess
                os.close(fd)
                raise OSError(errno.ESTALE, f"{path}: the tree changed while it was being removed")
            try:
                _remove(name, fd, is_dir=True)
            except OSError as exc:
                first_error = first_error or exc
    finally:
        os.close(parent_fd)
    if first_error is not None:
        raise first_error


__all__ = ["remove_tree", "walk"]
