"""What a local run sees of the filesystem: the overlays its mount namespace lays, and an episode's scratch tmpfs.

:func:`plan_overlays` decides where the run's mount namespace puts a tmpfs (the private temp dirs, the
concealed paths, an ancestor of the interpreter that "other" cannot traverse) and which host paths come back
under each; :mod:`.enter` lays them. :func:`mount_scratch` gives an episode's folder a tmpfs of its own in the
host's namespace. What this covers is in the threat model of :mod:`.local`.
"""

from __future__ import annotations

import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

#: Places every uid may write to; each gets a private tmpfs in the run's mount namespace.
PRIVATE_TMP_DIRS: tuple[str, ...] = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")


def _world_traversable(path: Path) -> bool:
    try:
        return bool(os.stat(path).st_mode & stat.S_IXOTH)
    except OSError:
        return False


def is_under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _minimal(paths: Sequence[Path]) -> list[Path]:
    """Drop paths that lie under another path of the list."""
    out: list[Path] = []
    for p in sorted(set(paths), key=lambda x: len(x.parts)):
        if not any(is_under(p, q) for q in out):
            out.append(p)
    return out


def package_root() -> Path:
    """The folder this process imports ``envloop_pipelines`` from (site-packages, or a checkout)."""
    import envloop_pipelines

    return Path(envloop_pipelines.__file__).resolve().parent.parent


def interpreter_paths() -> list[Path]:
    """Paths the project's Python needs to start and import ``envloop_pipelines``."""
    candidates = [Path(sys.prefix), Path(sys.base_prefix), Path(os.path.realpath(sys.executable)).parent,
                  package_root()]
    candidates += [Path(p) for p in sys.path if p and os.path.isdir(p)]
    return [p.resolve() for p in candidates if p.exists()]


@dataclass(frozen=True)
class Overlay:
    """A tmpfs over ``target`` with ``keep`` (absolute host paths under it) bound back in."""

    target: Path
    options: str
    keep: tuple[Path, ...]
    read_only: bool


def plan_overlays(keep: Sequence[Path], private_tmp: bool, tmp_size_mb: int,
                  conceal: Sequence[Path] = ()) -> list[Overlay]:
    concealed = _minimal([Path(c).resolve() for c in conceal if Path(c).exists()])
    # A kept path at or above a concealed one cannot be kept whole (the checkout holds the virtualenv):
    # what is kept inside the concealed path is bound back into its overlay instead.
    keep = _minimal([k for k in (p.resolve() for p in keep if p.exists())
                     if not any(is_under(c, k) for c in concealed)])
    targets: dict[Path, tuple[str, bool]] = {}
    if private_tmp:
        for name in PRIVATE_TMP_DIRS:
            path = Path(name)
            if path.is_dir() and not path.is_symlink():
                targets[path.resolve()] = (f"size={tmp_size_mb}m,mode=1777", False)
    # Concealed paths (the checkout, the EnvLoop home): an empty read-only folder, the kept paths bound back.
    # One under a private temp dir is hidden by that tmpfs already.
    for path in concealed:
        if not any(is_under(path, t) or is_under(t, path) for t in targets):
            targets[path] = ("size=64k,mode=755", True)
    # The topmost ancestor of a needed path that "other" cannot traverse (``/root`` 0700 with a
    # pyenv Python inside): a read-only tmpfs over it with only the needed paths bound back.
    for path in keep:
        for ancestor in reversed(path.parents):
            if ancestor != Path("/") and not _world_traversable(ancestor):
                if not any(is_under(ancestor, t) for t in targets):
                    targets[ancestor] = ("size=64k,mode=755", True)
                break
    # A concealed path under another overlay is hidden by it already (only the kept paths come back there).
    for path in concealed:
        if path in targets and any(t != path and is_under(path, t) for t in targets):
            del targets[path]
    overlays = []
    for target, (options, read_only) in sorted(targets.items(), key=lambda kv: len(kv[0].parts)):
        inside = tuple(p for p in keep if p != target and is_under(p, target))
        overlays.append(Overlay(target, options, inside, read_only))
    return overlays



def _libc() -> Any:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return libc


def mount_scratch(path: str | Path, size_mb: int) -> bool:
    """Mount a fresh tmpfs of ``size_mb`` MiB (mode 0700) over the empty folder ``path``, in this host's namespace.

    An episode's folder lives on one: a bind of a folder of it shows the folder's path *on that tmpfs*
    (``/work``) in ``/proc/self/mountinfo``, never its host path, and its disk use is bounded in total.
    Returns False where the host refuses (no root); the folder is then an ordinary one.
    """
    if os.geteuid() != 0:
        return False
    options = f"size={int(size_mb)}m,mode=0700".encode()
    return _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", 2 | 4, options) == 0  # MS_NOSUID | MS_NODEV


def unmount_scratch(path: str | Path) -> None:
    """Detach the tmpfs :func:`mount_scratch` put at ``path`` (its files go with it, whatever they are).

    Raises:
        OSError: the host refused.
    """
    if _libc().umount2(os.fsencode(path), 2) != 0:  # MNT_DETACH
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"umount {path}: {os.strerror(err)}")



__all__ = ["PRIVATE_TMP_DIRS", "Overlay", "interpreter_paths", "is_under", "mount_scratch", "package_root",
           "plan_overlays", "unmount_scratch"]
