"""What an attempt leaves in its working directory: planted rewards removed, the bounded snapshot stored.

Before any verification every ``reward.txt`` / ``reward.json`` an agent planted is deleted
(:func:`strip_rewards`); the final state stored with the transcript is :func:`snapshot_files` (bounded in
files, bytes per file and bytes in all).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

from envloop_pipelines.core.sandbox.tree import remove_tree, walk
from envloop_pipelines.core.storage import sha256_bytes

#: Files an agent might plant to claim a reward; removed before any verification.
REWARD_FILES: frozenset[str] = frozenset({"reward.txt", "reward.json"})
#: final_state keeps at most this many files, bytes per file and bytes in all (stored with the transcript).
FINAL_STATE_FILES = 200
FINAL_STATE_FILE_BYTES = 16 * 1024
FINAL_STATE_TOTAL_BYTES = 512 * 1024
#: The snapshot stops listing after this many folders and files (a tree of millions is cut, not walked).
FINAL_STATE_MAX_ENTRIES = 20_000

log = logging.getLogger(__name__)


def strip_rewards(root: Path) -> list[str]:
    """Delete every planted reward file under ``root`` (never following links, no recursion); returns their paths."""
    removed = []
    for dirpath, dirnames, filenames in walk(root):
        for name in [*filenames, *dirnames]:
            if name in REWARD_FILES:
                path = Path(dirpath) / name
                try:
                    remove_tree(path)
                except OSError:
                    log.warning("could not remove the planted %s", path)
                removed.append(os.path.relpath(path, root))
        dirnames[:] = [d for d in dirnames if d not in REWARD_FILES]
    return sorted(removed)


def _json_size(value: Any) -> int:
    """Bytes ``value`` takes in ``attempts.jsonl`` (escapes included: a NUL is six bytes there)."""
    return len(json.dumps(value, ensure_ascii=True, separators=(",", ":")))


def snapshot_files(root: Path) -> dict[str, Any]:
    """The bounded final state of a working directory (see ``docs/agents.md``, "What an attempt is").

    Files in walk order (sorted, top-down, never following links, no recursion), at most
    :data:`FINAL_STATE_FILES` of them and :data:`FINAL_STATE_TOTAL_BYTES` of JSON in all (names, escapes and
    all: the cap holds for what is stored). Each file: ``bytes`` (its size) and its first
    :data:`FINAL_STATE_FILE_BYTES` bytes as ``text`` (UTF-8 without NUL) or ``base64`` (anything else), with
    ``truncated`` when the file is longer; past the total, ``sha256_head`` alone. A name that is not UTF-8 is
    kept as Python's ``os.fsdecode`` gives it (each undecodable byte 0xXY as the lone surrogate U+DCXY,
    stored as the JSON escape ``\\udcXY``; ``os.fsencode`` gives the bytes back). Symlinks give their
    target, other special files ``special``.
    """
    files: dict[str, Any] = {}
    used = 0
    truncated = False
    visited = 0
    for dirpath, dirnames, filenames in walk(root):
        visited += 1 + len(filenames)
        if visited > FINAL_STATE_MAX_ENTRIES or len(files) >= FINAL_STATE_FILES:
            truncated = True
            break
        for name in filenames:
            if len(files) >= FINAL_STATE_FILES or used >= FINAL_STATE_TOTAL_BYTES:
                truncated = True
                break
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            entry = _file_entry(path)
            sha = entry.pop("_sha", None)
            cost = _json_size({rel: entry})
            if used + cost > FINAL_STATE_TOTAL_BYTES:
                truncated = True
                if sha is None:
                    break
                entry = {"bytes": entry["bytes"], "truncated": entry["truncated"], "sha256_head": sha}
                cost = _json_size({rel: entry})
                if used + cost > FINAL_STATE_TOTAL_BYTES:
                    break
            files[rel] = entry
            used += cost
    return {"files": files, "truncated": truncated}


def _file_entry(path: str) -> dict[str, Any]:
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return {"symlink": os.readlink(path)[:1024]}
        if not stat.S_ISREG(st.st_mode):
            return {"special": True}
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as fh:
            head = fh.read(FINAL_STATE_FILE_BYTES)
    except OSError as exc:
        return {"unreadable": exc.strerror or type(exc).__name__}
    entry: dict[str, Any] = {"bytes": st.st_size, "truncated": st.st_size > len(head),
                             "_sha": sha256_bytes(head)}
    text = None
    if b"\0" not in head:
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as exc:
            # A multi-byte character cut at the cap is still text.
            if len(head) == FINAL_STATE_FILE_BYTES and exc.start >= len(head) - 3 and exc.reason == "unexpected end of data":
                text = head[: exc.start].decode("utf-8")
    if text is not None:
        entry["text"] = text
    else:
        entry["base64"] = base64.b64encode(head).decode("ascii")
    return entry


__all__ = ["FINAL_STATE_FILES", "FINAL_STATE_FILE_BYTES", "FINAL_STATE_MAX_ENTRIES", "FINAL_STATE_TOTAL_BYTES",
           "REWARD_FILES", "snapshot_files", "strip_rewards"]
