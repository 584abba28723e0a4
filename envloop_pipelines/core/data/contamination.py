"""Contamination: training rows checked against the test and holdout inputs.

A training row and a hidden (test/holdout) record are each one or more text
fields: a row's state and its instructions (what the model reads), a hidden
record's state and its questions' instructions. The first field is the state.
Four tests per training row, against every hidden record:

- **exact**: the row's normalised state (lower case, punctuation dropped,
  whitespace collapsed) is a hidden record's state;
- **near duplicate**: Jaccard similarity of the two states' word 5-gram
  shingles ≥ ``near_dup_jaccard``; and, for states with words replaced
  (issue 34: a test state with every 12th word replaced shares no 13-gram and
  a 5-gram Jaccard of ~0.43, and passed), Jaccard of their word 3-gram shingles
  ≥ ``minhash_jaccard``, the candidates found by MinHash LSH (``datasketch``)
  and their Jaccard computed exactly. The threshold 0.5 is measured: on the
  built-in benchmark (seed 0, 240 users) no train state reaches a 3-gram
  Jaccard of 0.375 with any test or holdout state (max 0.374, 99th percentile
  0.304 over the 1,152 train records: 0 false positives at 0.5), while a test
  state with every 12th word replaced keeps 0.584 or more (median 0.617, 200
  states); against the powered hidden splits (864 users each, 13,824
  records) 3 of the 1,152 train records reach 0.5 (max 0.605), and are
  removed with the other overlapping rows;
- **n-gram overlap** (the row's side): the share of the row state's word
  13-grams found anywhere in the test/holdout states ≥ ``ngram_overlap``;
- **containment** (the hidden record's side): the share of one hidden
  record's distinctive 13-grams (its state's and its instructions') found in
  the row, over all the row's fields (state and instructions), ≥
  ``containment``. This is the test that finds a hidden state inside a longer
  row (a verbatim test state padded with as many other words has an n-gram
  overlap of about a half or less, and a containment of 1). A 13-gram found in
  more than ``boilerplate_max_records`` hidden records is template text (the
  built-in benchmark's question instructions, its shared phrasing), not one
  record's content: it counts for neither side of the containment. A hidden
  record whose every 13-gram is template text is not measured by this test
  (``n_reference_unmeasured``).

13 words is long enough that template phrasing shared by unrelated records
rarely matches (the GPT-3 paper's decontamination n-gram length). Grams never
cross fields, and a field shorter than the gram is one gram of its own. Grams
are held as hashes (64-bit, within one process), so the check of a few
thousand rows against the built-in benchmark's ~14,000 hidden records takes
seconds.

Only inputs are needed (states and instructions), so the training side can
run it without ever reading hidden labels.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence, Union

from datasketch import MinHash, MinHashLSH

_WORD = re.compile(r"\w+", re.UNICODE)

#: A row's or a hidden record's text: one string, or its fields (the state first).
Text = Union[str, Sequence[str]]


def normalise(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def shingles(words: Sequence[str], n: int) -> set[tuple[str, ...]]:
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def hashed_shingles(words: Sequence[str], n: int) -> set[int]:
    """:func:`shingles` as hashes of the joined words (cheaper to build, hold and intersect)."""
    if len(words) < n:
        return {hash(" ".join(words))} if words else set()
    return {hash(" ".join(words[i : i + n])) for i in range(len(words) - n + 1)}


def _fields(text: Text) -> list[str]:
    fields = [text] if isinstance(text, str) else [str(t) for t in text if t is not None]
    if not fields:
        raise ValueError("a contamination text needs at least one field (the state)")
    return fields


@dataclass(frozen=True)
class ContaminationConfig:
    near_dup_jaccard: float = 0.8
    ngram_overlap: float = 0.5
    containment: float = 0.5
    boilerplate_max_records: int = 10
    shingle_n: int = 5
    ngram_n: int = 13
    #: Word 3-gram Jaccard of a state with words replaced (measured: module docstring).
    minhash_jaccard: float = 0.5
    minhash_n: int = 3
    #: MinHash permutations; the LSH looks for candidates from 0.1 under the threshold (an estimate's standard
    #: error at J = 0.55 and 128 permutations is ~0.044), and each candidate's Jaccard is then computed exactly.
    minhash_perm: int = 128


@dataclass
class ContaminationReport:
    n_rows: int
    n_reference: int
    exact: list[dict[str, Any]] = field(default_factory=list)
    near_duplicate: list[dict[str, Any]] = field(default_factory=list)
    ngram_overlap: list[dict[str, Any]] = field(default_factory=list)
    containment: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    n_reference_unmeasured: int = 0

    @property
    def flagged_rows(self) -> set[int]:
        return {f["row"] for f in self.exact + self.near_duplicate + self.ngram_overlap + self.containment}

    @property
    def clean(self) -> bool:
        return not self.flagged_rows

    def to_dict(self) -> dict[str, Any]:
        return {"n_rows": self.n_rows, "n_reference": self.n_reference, "clean": self.clean,
                "n_flagged": len(self.flagged_rows), "exact": self.exact, "near_duplicate": self.near_duplicate,
                "ngram_overlap": self.ngram_overlap, "containment": self.containment,
                "n_reference_unmeasured": self.n_reference_unmeasured, "config": self.config}


def _grams(fields: Sequence[Sequence[str]], n: int) -> set[int]:
    out: set[int] = set()
    for words in fields:
        out |= hashed_shingles(words, n)
    return out


def _nearest(sh: set[int], index: Mapping[int, list[int]], ref_sh: Sequence[set[int]],
             threshold: float) -> tuple[int | None, float]:
    """The hidden state most similar to ``sh`` (Jaccard), among those that can reach ``threshold``.

    Jaccard ≥ t needs at least ``t·|sh|`` shared shingles, so a candidate shares one of the
    ``|sh| - ceil(t·|sh|) + 1`` rarest shingles of ``sh`` (prefix filtering): only those are looked up,
    not the template shingles that thousands of hidden states share.
    """
    if not sh:
        return None, 0.0
    need = math.ceil(threshold * len(sh) - 1e-9)
    rarest = sorted(sh, key=lambda s: len(index.get(s, ())))[: max(len(sh) - need + 1, 1)]
    best, best_j = 0.0, None
    for j in sorted({j for s in rarest for j in index.get(s, ())}):
        inter = len(sh & ref_sh[j])
        jac = inter / (len(sh) + len(ref_sh[j]) - inter)
        if jac > best:
            best, best_j = jac, j
    return best_j, best


def _word_grams(words: Sequence[str], n: int) -> set[str]:
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


class _ReplacedWords:
    """The hidden states' word n-gram sets in a MinHash LSH index: the states a row's state may be, words replaced."""

    def __init__(self, states: Sequence[set[str]], config: ContaminationConfig) -> None:
        self.states, self.config = states, config
        self.lsh = MinHashLSH(threshold=max(config.minhash_jaccard - 0.1, 0.05), num_perm=config.minhash_perm)
        hashes = MinHash.bulk([[g.encode("utf-8") for g in s] for s in states], num_perm=config.minhash_perm)
        with self.lsh.insertion_session() as session:
            for j, mh in enumerate(hashes):
                if states[j]:
                    session.insert(j, mh, check_duplication=False)

    def nearest(self, grams: set[str]) -> tuple[int | None, float]:
        """The hidden state with the highest exact Jaccard among the LSH's candidates."""
        if not grams:
            return None, 0.0
        mh = MinHash(num_perm=self.config.minhash_perm)
        mh.update_batch([g.encode("utf-8") for g in grams])
        best, best_j = 0.0, None
        for j in sorted(self.lsh.query(mh)):
            inter = len(grams & self.states[j])
            jac = inter / (len(grams) + len(self.states[j]) - inter)
            if jac > best:
                best, best_j = jac, j
        return best_j, best


def check_contamination(
    rows: Sequence[tuple[str, Text]],
    reference: Iterable[tuple[str, Text]],
    config: ContaminationConfig = ContaminationConfig(),
) -> ContaminationReport:
    """Find training rows that overlap the hidden (test + holdout) inputs, measured both ways.

    Args:
        rows: ``(row id, text)`` of the training snapshot; text is a string or the row's fields
            (state, instructions).
        reference: ``(split/record id, text)`` of the test and holdout records; text is a string or
            the record's fields (state, then its questions' instructions).
        config: thresholds.
    """
    ref_ids: list[str] = []
    ref_exact: dict[str, str] = {}
    ref_state_sh: list[set[int]] = []
    sh_index: dict[int, list[int]] = defaultdict(list)
    ref_grams: list[set[int]] = []
    ref_words: list[set[str]] = []
    all_state_grams: set[int] = set()
    for ref_id, text in reference:
        fields = [normalise(f) for f in _fields(text)]
        j = len(ref_ids)
        ref_ids.append(ref_id)
        ref_exact.setdefault(" ".join(fields[0]), ref_id)
        sh = hashed_shingles(fields[0], config.shingle_n)
        for s in sh:
            sh_index[s].append(j)
        ref_state_sh.append(sh)
        ref_words.append(_word_grams(fields[0], config.minhash_n))
        state_grams = hashed_shingles(fields[0], config.ngram_n)
        all_state_grams |= state_grams
        ref_grams.append(state_grams | _grams(fields[1:], config.ngram_n))
    records_of = Counter(g for grams in ref_grams for g in grams)
    # containment: each record's distinctive grams (template text, in many records, left out)
    gram_index: dict[int, list[int]] = defaultdict(list)
    distinctive = [0] * len(ref_grams)
    for j, grams in enumerate(ref_grams):
        for g in grams:
            if records_of[g] <= config.boilerplate_max_records:
                gram_index[g].append(j)
                distinctive[j] += 1
    del ref_grams, records_of
    replaced = _ReplacedWords(ref_words, config)
    replaced_cache: dict[str, tuple[int | None, float]] = {}
    report = ContaminationReport(n_rows=len(rows), n_reference=len(ref_ids), config=config.__dict__.copy(),
                                 n_reference_unmeasured=sum(1 for d in distinctive if d == 0))
    # several questions share one state: score it once
    near_cache: dict[str, tuple[int | None, float]] = {}
    overlap_cache: dict[str, float] = {}
    for i, (row_id, text) in enumerate(rows):
        fields = [normalise(f) for f in _fields(text)]
        key = " ".join(fields[0])
        if key in ref_exact:
            report.exact.append({"row": i, "id": row_id, "matches": ref_exact[key]})
            continue
        if key not in near_cache:
            near_cache[key] = _nearest(hashed_shingles(fields[0], config.shingle_n), sh_index, ref_state_sh,
                                       config.near_dup_jaccard)
        best_j, best = near_cache[key]
        if best >= config.near_dup_jaccard and best_j is not None:
            report.near_duplicate.append({"row": i, "id": row_id, "matches": ref_ids[best_j], "jaccard": round(best, 4)})
            continue
        if key not in overlap_cache:
            grams = hashed_shingles(fields[0], config.ngram_n)
            overlap_cache[key] = len(grams & all_state_grams) / len(grams) if grams else 0.0
        overlap = overlap_cache[key]
        if overlap >= config.ngram_overlap:
            report.ngram_overlap.append({"row": i, "id": row_id, "overlap": round(overlap, 4)})
            continue
        hits: dict[int, int] = defaultdict(int)
        for g in _grams(fields, config.ngram_n):
            for j in gram_index.get(g, ()):
                hits[j] += 1
        share, match = max(((n / distinctive[j], j) for j, n in hits.items()), default=(0.0, None))
        if share >= config.containment and match is not None:
            report.containment.append({"row": i, "id": row_id, "matches": ref_ids[match],
                                       "containment": round(share, 4)})
            continue
        # Last: a state with words replaced, which no test above sees (word 3-grams, MinHash LSH).
        if key not in replaced_cache:
            replaced_cache[key] = replaced.nearest(_word_grams(fields[0], config.minhash_n))
        best_j, best = replaced_cache[key]
        if best >= config.minhash_jaccard and best_j is not None:
            report.near_duplicate.append({"row": i, "id": row_id, "matches": ref_ids[best_j], "jaccard": round(best, 4),
                                          "shingle_n": config.minhash_n, "found_by": "minhash_lsh"})
    return report


def row_texts(table: Any) -> list[tuple[str, tuple[str, str]]]:
    """``(record id, (state, instructions))`` of each question row of ``table``: what the model reads."""
    return list(zip(table.column("record_id").to_pylist(),
                    zip(table.column("state_text").to_pylist(), table.column("instructions_text").to_pylist())))


def record_texts(table: Any, split: str) -> list[tuple[str, list[str]]]:
    """``(split/record id, [state, its questions' distinct instructions...])``, one entry per record of ``table``.

    A record's questions share its state, so each hidden record is measured once.
    """
    records: dict[str, list[str]] = {}
    for rid, state, instructions in zip(table.column("record_id").to_pylist(), table.column("state_text").to_pylist(),
                                        table.column("instructions_text").to_pylist()):
        fields = records.setdefault(f"{split}/{rid}", [state])
        if instructions not in fields[1:]:
            fields.append(instructions)
    return list(records.items())


__all__ = ["ContaminationConfig", "ContaminationReport", "check_contamination", "hashed_shingles", "normalise",
           "record_texts", "row_texts", "shingles"]
