"""Writing into a local run's working directory and handing it to the run's uid, never through a planted link.

A previous run may have left symlinks and hard links in a working directory the caller reuses (an episode's
state); root's writes and ``chown`` must not follow them out of it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from envloop_pipelines.core.sandbox.tree import walk


def safe_write(root: Path, rel: str, data: bytes) -> None:
    """Write ``root/rel`` without following any symlink a previous run may have planted."""
    parts = Path(rel).parts
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise ValueError(f"file name {rel!r} must be a relative path inside the working directory")
    current = root
    for part in parts[:-1]:
        current = current / part
        if current.is_symlink():
            raise ValueError(f"{current} is a symlink; refusing to write through it")
        current.mkdir(exist_ok=True)
    fd = os.open(current / parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def chown_tree(root: Path, uid: int) -> None:
    """Give the run's uid its working directory.

    Never follows symlinks and skips files with more than one hard link: a
    previous run's link to a file outside the directory must not make us
    change that file's owner.
    """
    os.chown(root, uid, uid, follow_symlinks=False)
    os.chmod(root, 0o700)
    for dirpath, dirnames, filenames in walk(root):  # no recursion: a previous run may have left any depth
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode) or (not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1):
                    continue
                os.chown(path, uid, uid, follow_symlinks=False)
            except OSError as exc:
                if exc.errno not in (errno.ENAMETOOLONG, errno.ENOENT):  # past PATH_MAX: left as it is
                    raise


__all__ = ["chown_tree", "safe_write"]
