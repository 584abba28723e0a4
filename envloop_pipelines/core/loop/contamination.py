"""Contamination: training rows checked against the test and holdout inputs.

Three tests per training row, against every test/holdout state text:

- **exact**: the normalised state text (lower case, punctuation dropped,
  whitespace collapsed) is identical;
- **near duplicate**: Jaccard similarity of word 5-gram shingles ≥ ``near_dup_jaccard``;
- **n-gram overlap**: the share of the row's word 13-grams found anywhere in
  test/holdout ≥ ``ngram_overlap``. 13 words is long enough that template
  phrasing shared by unrelated records rarely matches (the GPT-3 paper's
  decontamination n-gram length).

Only inputs are needed (states), so the training side can run it without ever
reading hidden labels.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

_WORD = re.compile(r"\w+", re.UNICODE)


def normalise(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def shingles(words: Sequence[str], n: int) -> set[tuple[str, ...]]:
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@dataclass(frozen=True)
class ContaminationConfig:
    near_dup_jaccard: float = 0.8
    ngram_overlap: float = 0.5
    shingle_n: int = 5
    ngram_n: int = 13


@dataclass
class ContaminationReport:
    n_rows: int
    n_reference: int
    exact: list[dict[str, Any]] = field(default_factory=list)
    near_duplicate: list[dict[str, Any]] = field(default_factory=list)
    ngram_overlap: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def flagged_rows(self) -> set[int]:
        return {f["row"] for f in self.exact + self.near_duplicate + self.ngram_overlap}

    @property
    def clean(self) -> bool:
        return not self.flagged_rows

    def to_dict(self) -> dict[str, Any]:
        return {"n_rows": self.n_rows, "n_reference": self.n_reference, "clean": self.clean,
                "n_flagged": len(self.flagged_rows), "exact": self.exact, "near_duplicate": self.near_duplicate,
                "ngram_overlap": self.ngram_overlap, "config": self.config}


def check_contamination(
    rows: Sequence[tuple[str, str]],
    reference: Iterable[tuple[str, str]],
    config: ContaminationConfig = ContaminationConfig(),
) -> ContaminationReport:
    """Find training rows that overlap the reference (test + holdout) states.

    Args:
        rows: ``(row id, state text)`` of the training snapshot.
        reference: ``(split/record id, state text)`` of test and holdout inputs.
        config: thresholds.
    """
    ref_exact: dict[str, str] = {}
    ref_shingles: list[tuple[str, set[tuple[str, ...]]]] = []
    index: dict[tuple[str, ...], list[int]] = defaultdict(list)
    ref_ngrams: set[tuple[str, ...]] = set()
    for ref_id, text in reference:
        words = normalise(text)
        ref_exact.setdefault(" ".join(words), ref_id)
        sh = shingles(words, config.shingle_n)
        for s in sh:
            index[s].append(len(ref_shingles))
        ref_shingles.append((ref_id, sh))
        ref_ngrams |= shingles(words, config.ngram_n)
    report = ContaminationReport(n_rows=len(rows), n_reference=len(ref_shingles), config=config.__dict__.copy())
    seen_texts: dict[str, tuple[str | None, float, float]] = {}
    for i, (row_id, text) in enumerate(rows):
        words = normalise(text)
        key = " ".join(words)
        if key in ref_exact:
            report.exact.append({"row": i, "id": row_id, "matches": ref_exact[key]})
            continue
        if key not in seen_texts:  # several questions share one state: score each state once
            sh = shingles(words, config.shingle_n)
            counts: dict[int, int] = defaultdict(int)
            for s in sh:
                for j in index.get(s, ()):
                    counts[j] += 1
            best, best_j = 0.0, None
            for j, inter in counts.items():
                jac = inter / (len(sh) + len(ref_shingles[j][1]) - inter)
                if jac > best:
                    best, best_j = jac, j
            grams = shingles(words, config.ngram_n)
            overlap = len(grams & ref_ngrams) / len(grams) if grams else 0.0
            seen_texts[key] = (None if best_j is None else ref_shingles[best_j][0], best, overlap)
        match, best, overlap = seen_texts[key]
        if best >= config.near_dup_jaccard:
            report.near_duplicate.append({"row": i, "id": row_id, "matches": match, "jaccard": round(best, 4)})
        elif overlap >= config.ngram_overlap:
            report.ngram_overlap.append({"row": i, "id": row_id, "overlap": round(overlap, 4)})
    return report
