"""The SFT snapshot of an RL round: verified attempts as chat rows, contamination-checked, content-addressed.

A row is one attempt the verifier passed, in the chat format it was recorded
in (``messages`` with the assistant's ``tool_calls`` and the ``tool``
results, ``tools``), with its provenance: the dataset and its version, the
environment id, its seed and split, the attempt's index and sampling seed,
the agent, and the transcript's sha256, so every row names the attempt it
came from (:class:`~envloop_pipelines.core.agents.attempts.Attempt`).

Contamination (rule 7, ``docs/rsi-rules.md``) is checked against the held-out
environments before the snapshot is used:

* **environment**: a row from a held-out environment (its id is a held-out id, or its split is not
  ``train``) is contamination by definition;
* **text**: the row's environment text (instruction and starting files) against every held-out
  environment's, by :func:`~envloop_pipelines.core.data.contamination.check_contamination`
  (exact normalised text, near-duplicate word shingles, 13-gram overlap both ways: the row's 13-grams
  found in held-out text, and a held-out environment's 13-grams contained in the row), the decision
  loop's check applied to environments.

Flagged rows are removed (policy ``remove``) or make the build fail (policy ``refuse``); the
report is stored with the snapshot either way. Only inputs are compared: held-out environments
give their instruction and files, never their verifier side.

Layout, under ``<root>/<sha256>/`` (``sha256`` of ``rows.jsonl``; written once, read-only)::

    rows.jsonl           one canonical JSON row per line, in (environment, attempt) order
    contamination.json   the report (what was flagged, why, and what was removed)
    manifest.json        format, counts, source attempts' hash, sha256 of the files
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from envloop_pipelines.core.data.contamination import ContaminationConfig, check_contamination
from envloop_pipelines.core.environments.spec import TRAIN_SPLIT
from envloop_pipelines.core.ledger.store import JsonRecord
from envloop_pipelines.core.storage import canonical_json, make_read_only, publish_dir, sha256_bytes, sha256_file, staging_dir

FORMAT = "envloop-sft-snapshot/1"
ROWS_FILE = "rows.jsonl"
CONTAMINATION_FILE = "contamination.json"
MANIFEST_FILE = "manifest.json"


class ContaminatedSnapshotError(ValueError):
    """Policy ``refuse``: rows overlap the held-out environments; the report names them."""


def environment_text(spec: Any) -> str:
    """What an environment shows an agent, as text: its instruction, then each starting file (path, content)."""
    parts = [str(spec.instruction)]
    for path in sorted(getattr(spec, "files", None) or {}):
        parts.append(f"{path}\n{spec.files[path]}")
    question = getattr(spec, "question", None)
    if question:
        parts.append(str(question.get("state_text") or ""))
    return "\n".join(parts)


@dataclass(frozen=True)
class SftSnapshot(JsonRecord):
    """A built SFT snapshot.

    Attributes:
        sha256: the snapshot's identity (sha256 of ``rows.jsonl``).
        path: its folder.
        n_rows: rows kept.
        n_attempts: attempts offered.
        n_passed: attempts the verifier passed.
        n_removed: passed attempts removed as contamination.
        contamination: the report.
    """

    sha256: str
    path: str
    n_rows: int
    n_attempts: int
    n_passed: int
    n_removed: int
    contamination: Mapping[str, Any] = field(default_factory=dict)

    def rows(self) -> list[dict[str, Any]]:
        return read_sft_rows(self.path)


def sft_row(attempt: Any) -> dict[str, Any]:
    """One passed attempt as an SFT row with its provenance."""
    return {
        "id": f"{attempt.environment_id}#{attempt.attempt}",
        "messages": [dict(m) for m in attempt.messages],
        "tools": [dict(t) for t in attempt.tools],
        "provenance": {
            "dataset": attempt.dataset, "dataset_version": attempt.dataset_version,
            "environment_id": attempt.environment_id, "split": attempt.split, "seed": attempt.seed,
            "attempt": attempt.attempt, "sampling_seed": attempt.sampling_seed, "agent": dict(attempt.agent),
            "transcript_sha256": attempt.transcript_sha256(),
        },
    }


def build_sft_snapshot(
    attempts: Sequence[Any],
    *,
    train_texts: Mapping[str, str],
    holdout_texts: Mapping[str, str],
    root: str | Path,
    policy: str = "remove",
    config: ContaminationConfig = ContaminationConfig(),
) -> SftSnapshot:
    """Keep the attempts the verifier passed, check them against the held-out environments, store them.

    Args:
        attempts: the round's sampled attempts (``Attempt`` records).
        train_texts: environment id -> :func:`environment_text` of the training environments.
        holdout_texts: the same for the held-out environments (inputs only).
        root: the folder of content-addressed snapshots.
        policy: ``remove`` (drop flagged rows) or ``refuse`` (raise when any row is flagged).
        config: the contamination thresholds.

    Raises:
        ContaminatedSnapshotError: policy ``refuse`` and a row is flagged.
        ValueError: an unknown policy.
    """
    if policy not in ("remove", "refuse"):
        raise ValueError(f"contamination policy must be 'remove' or 'refuse', got {policy!r}")
    passed = sorted((a for a in attempts if a.passed), key=lambda a: (a.environment_id, a.attempt))
    rows = [sft_row(a) for a in passed]
    by_id: dict[str, dict[str, Any]] = {}
    for row, attempt in zip(rows, passed):
        reasons = []
        if attempt.environment_id in holdout_texts:
            reasons.append("the environment is held out")
        if attempt.split != TRAIN_SPLIT:
            reasons.append(f"the attempt's split is {attempt.split!r}, not {TRAIN_SPLIT!r}")
        if reasons:
            by_id[row["id"]] = {"id": row["id"], "test": "environment", "reasons": reasons}
    texts = []
    for row, attempt in zip(rows, passed):
        text = train_texts.get(attempt.environment_id)
        if text is None:  # not a known training environment: check what the agent was told
            text = "\n".join(str(m.get("content") or "") for m in attempt.messages if m.get("role") == "user")
        texts.append((row["id"], text))
    report = check_contamination(texts, sorted(holdout_texts.items()), config)
    for test, found in (("exact", report.exact), ("near_duplicate", report.near_duplicate),
                        ("ngram_overlap", report.ngram_overlap), ("containment", report.containment)):
        for f in found:
            by_id.setdefault(f["id"], {"id": f["id"], "test": test, "reasons": []})["reasons"].append(
                {k: v for k, v in f.items() if k not in ("row", "id")} | {"test": test})
    flagged = sorted(by_id)
    body = {"policy": policy, "n_rows": len(rows), "n_heldout": len(holdout_texts), "flagged": [by_id[i] for i in flagged],
            "removed": flagged if policy == "remove" else [], "clean": not flagged, "config": report.config}
    if flagged and policy == "refuse":
        raise ContaminatedSnapshotError(f"{len(flagged)} of {len(rows)} SFT rows overlap the held-out environments "
                                        f"(policy refuse): {flagged[:5]}")
    kept = [r for r in rows if r["id"] not in by_id]
    data = b"".join(canonical_json(r) + b"\n" for r in kept)
    sha = sha256_bytes(data)
    root = Path(root)
    final = root / sha
    if not final.exists():
        stage = staging_dir(root)
        (stage / ROWS_FILE).write_bytes(data)
        (stage / CONTAMINATION_FILE).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        source = sha256_bytes(b"".join(canonical_json(a.to_dict()) + b"\n" for a in sorted(attempts, key=lambda a: a.key)))
        manifest = {"format": FORMAT, "sha256": sha, "n_rows": len(kept), "n_attempts": len(attempts), "n_passed": len(passed),
                    "n_removed": len(rows) - len(kept), "source_attempts_sha256": source,
                    "datasets": sorted({f"{a.dataset}@{a.dataset_version}" for a in attempts}),
                    "files": {n: sha256_file(stage / n) for n in (ROWS_FILE, CONTAMINATION_FILE)}}
        (stage / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        make_read_only(stage)
        publish_dir(stage, final)
    return SftSnapshot(sha256=sha, path=str(final), n_rows=len(kept), n_attempts=len(attempts), n_passed=len(passed),
                       n_removed=len(rows) - len(kept), contamination=json.loads((final / CONTAMINATION_FILE).read_text()))


def read_sft_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a snapshot folder, its hash checked.

    Raises:
        ValueError: ``rows.jsonl`` does not hash to the folder's name, or a line is not a row (file and line named).
    """
    path = Path(path)
    data = (path / ROWS_FILE).read_bytes()
    if sha256_bytes(data) != path.name:
        raise ValueError(f"{path / ROWS_FILE}: sha256 {sha256_bytes(data)[:12]}... does not match the snapshot {path.name[:12]}...")
    rows = []
    for n, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path / ROWS_FILE}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or "provenance" not in row:
            raise ValueError(f"{path / ROWS_FILE}:{n}: field 'messages' (a list) and 'provenance' are required")
        rows.append(row)
    return rows


__all__ = ["CONTAMINATION_FILE", "ContaminatedSnapshotError", "FORMAT", "MANIFEST_FILE", "ROWS_FILE", "SftSnapshot",
           "build_sft_snapshot", "environment_text", "read_sft_rows", "sft_row"]
