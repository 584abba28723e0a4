"""Content-addressed, atomic, never-overwritten files under the EnvLoop home.

The home is ``./.envloop`` unless ``ENVLOOP_HOME`` says otherwise; it is read
when a function is called, never at import time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

ENVLOOP_HOME_ENV = "ENVLOOP_HOME"
DEFAULT_HOME = ".envloop"


def envloop_home(home: str | Path | None = None) -> Path:
    """The EnvLoop home: ``home`` if given, else ``$ENVLOOP_HOME``, else ``./.envloop``."""
    return Path(home or os.environ.get(ENVLOOP_HOME_ENV) or DEFAULT_HOME).resolve()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def canonical_json(value: Any) -> bytes:
    """Stable JSON bytes for hashing: sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def read_jsonl(path: str | Path, error: type[Exception] = ValueError) -> list[tuple[int, Any]]:
    """The values of a JSON-lines file with their 1-based line numbers (blank lines skipped).

    Raises:
        error: a line that is not JSON, naming the file, the line and the column.
    """
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as exc:
                raise error(f"{path}:{n}: not JSON ({exc.msg} at column {exc.colno})") from None
    return rows


def atomic_write_bytes(path: str | Path, data: bytes, *, overwrite: bool = False) -> Path:
    """Write ``data`` to ``path`` through a temp file and a rename.

    Readers see the old file or the whole new one, never half of it. With
    ``overwrite=False`` an existing file is an error (artifacts are immutable).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} exists and artifacts are never overwritten")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}{_owner_tag()}", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_json(path: str | Path, value: Any, *, overwrite: bool = False) -> Path:
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, indent=2) + "\n"
    return atomic_write_bytes(path, text.encode("utf-8"), overwrite=overwrite)


#: The one Parquet encoding of the project. Content addressing needs the same table to give the same
#: bytes: zstd, dictionary encoding, and no column statistics (min/max per row group, which nothing
#: here reads). These are the options data snapshots have always been written with, so their
#: file hashes, and the snapshot ids made from them, do not move.
PARQUET_OPTIONS: dict[str, Any] = {"compression": "zstd", "use_dictionary": True, "write_statistics": False}


def parquet_bytes(table: pa.Table) -> bytes:
    """The Parquet bytes of ``table`` (:data:`PARQUET_OPTIONS`): the same table gives the same bytes.

    Use it to hash before writing (content addressing), then :func:`atomic_write_bytes` the bytes.
    """
    import pyarrow as pa  # here, not at the top: most users of this module never write a table
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **PARQUET_OPTIONS)
    return sink.getvalue().to_pybytes()


def atomic_write_parquet(path: str | Path, table: pa.Table, *, overwrite: bool = False) -> Path:
    """Write ``table`` to ``path`` as Parquet (:func:`parquet_bytes`) through :func:`atomic_write_bytes`.

    Args:
        path: the file; its parent folders are created.
        table: the Arrow table.
        overwrite: replace an existing file; by default an existing file is an error
            (artifacts are immutable).

    Returns:
        ``path``.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
    """
    return atomic_write_bytes(path, parquet_bytes(table), overwrite=overwrite)


_OWNER_SEP = "~"


def _owner_tag() -> str:
    """``~<pid>~<host>~``: the writer of a temp file or staging directory, so leftovers can be told apart."""
    return f"{_OWNER_SEP}{os.getpid()}{_OWNER_SEP}{socket.gethostname()}{_OWNER_SEP}"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a zombie counts until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def sweep_stale(parent: str | Path) -> list[Path]:
    """Remove the temp files and staging directories that a dead process left in ``parent``.

    A writer killed mid-write (SIGKILL, OOM, a lost pod) leaves ``.<name>~<pid>~<host>~*.tmp``
    or ``.staging~<pid>~<host>~*``. They are never read (only a rename publishes), but they
    would pile up; this removes those whose process on this host is gone. Entries of live
    processes, and of other hosts (which this host cannot check), are left alone.
    """
    parent = Path(parent)
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    host = socket.gethostname()
    for entry in parent.iterdir():
        parts = entry.name.split(_OWNER_SEP)
        if not entry.name.startswith(".") or len(parts) < 4 or parts[2] != host or not parts[1].isdigit():
            continue
        if int(parts[1]) == os.getpid() or pid_alive(int(parts[1])):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def staging_dir(parent: str | Path) -> Path:
    """A fresh temp directory beside its final place (same filesystem, so rename is atomic).

    Staging directories that dead processes left in ``parent`` are swept first (:func:`sweep_stale`).
    """
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(parent)
    return Path(tempfile.mkdtemp(prefix=f".staging{_owner_tag()}", dir=parent))


def publish_dir(staged: Path, final: Path) -> bool:
    """Move a fully written ``staged`` directory to ``final`` atomically.

    Returns True when published, False when ``final`` already existed (content
    addressing: the same name means the same content, so the staged copy is
    dropped and nothing is overwritten).
    """
    try:
        os.rename(staged, final)
    except OSError:
        if final.exists():
            shutil.rmtree(staged, ignore_errors=True)
            return False
        raise
    return True


def make_read_only(root: Path) -> None:
    """Drop write permission on every file under ``root`` (immutable artifacts)."""
    for path in root.rglob("*"):
        if path.is_file():
            path.chmod(0o444)
