"""Generators of environment datasets: the shell family, a task snapshot's decision questions, synthesized rows.

Each generator is a pure function of its parameters (the same parameters give
the same environments, so the same dataset version), and
:func:`generate_dataset` stores its output with the parameters as the
dataset's ``source``.

* ``shell``: :func:`~.shell.shell_spec` for seeds ``seed .. seed+n-1`` as terminal environments with the
  terminal-state check and the reference solution; ``heldout`` of them, drawn with ``random.Random(seed)``,
  in split ``heldout``.
* ``decision``: questions of an **open** split (train, val, dev) of a task snapshot as decision environments
  whose ``rule`` verifier holds the question's label row. Test and holdout labels are read by the verifier
  alone (``core/verify``) and never written into a dataset: those splits are refused.
* :func:`decision_environments_from_table`: rows with labels (the loop's synthesized training rows) as decision
  environments; ``environment_synthesis`` stores its rows this way.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from envloop_pipelines.core.data.splits import HIDDEN_SPLITS, OPEN_SPLITS
from envloop_pipelines.core.environments.dataset import EnvironmentDataset, store_dataset
from envloop_pipelines.core.environments.shell import SHELL_FAMILIES, shell_spec
from envloop_pipelines.core.environments.spec import HOLDOUT_SPLIT, TRAIN_SPLIT, EnvironmentSpec, VerifierSpec

#: The generators :func:`generate_dataset` (and ``envloop env generate``) knows.
GENERATORS: tuple[str, ...] = ("shell", "decision")
_LABEL_KEYS = ("record_id", "question_id", "family", "type", "option_keys", "label", "soft_label")
_QUESTION_KEYS = ("state_text", "instructions_text", "option_keys", "option_texts", "type")


def heldout_indices(n: int, heldout: int, seed: int) -> set[int]:
    """Which of ``n`` environments are held out: ``heldout`` of them drawn by ``random.Random(seed)``."""
    if isinstance(heldout, bool) or not isinstance(heldout, int) or not 0 <= heldout <= n:
        raise ValueError(f"heldout must be an integer from 0 to n ({n}), got {heldout!r}")
    return set(random.Random(seed).sample(range(n), heldout))


def shell_environments(n: int, *, heldout: int = 0, seed: int = 0,
                       families: Sequence[str] = SHELL_FAMILIES) -> list[EnvironmentSpec]:
    """``n`` terminal environments of the shell family (seeds ``seed .. seed+n-1``), ``heldout`` held out.

    Args:
        n: how many environments (at least 1).
        heldout: how many of them go to split ``heldout`` (drawn with ``random.Random(seed)``).
        seed: the first environment seed, and the seed of the split.
        families: the shell families to draw from.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    held = heldout_indices(n, heldout, seed)
    out = []
    for i in range(n):
        s = shell_spec(seed + i, families)
        out.append(EnvironmentSpec(
            id=f"shell/{seed + i:04d}", kind="terminal", instruction=s.prompt, files=dict(s.files),
            verifier=VerifierSpec("terminal", dict(s.check_params)), seed=seed + i,
            split=HOLDOUT_SPLIT if i in held else TRAIN_SPLIT, solution=s.solution,
            meta={"generator": "shell", "family": s.family}))
    return out


def _env_id(record_id: str, question_id: str, taken: set[str]) -> str:
    """``record_id#question_id`` in the characters an environment id allows (others become '_'), unique."""
    base = re.sub(r"[^A-Za-z0-9._/#-]", "_", f"{record_id}#{question_id}")
    while ".." in base:
        base = base.replace("..", "._")
    base = base[:190].strip("/") or "q"
    env_id, k = base, 1
    while env_id in taken:
        env_id, k = f"{base}-{k}", k + 1
    taken.add(env_id)
    return env_id


def _solution(row: Mapping[str, Any]) -> str | None:
    label, keys = row.get("label"), list(row["option_keys"])
    if row.get("soft_label") is None and isinstance(label, int) and 0 <= label < len(keys):
        return keys[label]
    return None


def decision_environments_from_table(table: pa.Table, *, heldout: int = 0, seed: int = 0,
                                     meta: Mapping[str, Any] | None = None,
                                     row_meta: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
                                     ) -> list[EnvironmentSpec]:
    """Question rows with their labels (``QUESTION_SCHEMA`` columns) as decision environments.

    Rows with neither a label nor a soft label are skipped (there is nothing to verify). The environment's
    seed is the row's index in ``table``; its ``rule`` verifier holds the row's label columns.

    Args:
        table: rows with ``record_id, question_id, family, type, state_text, instructions_text, option_keys,
            option_texts, label, soft_label``.
        heldout: how many environments go to split ``heldout`` (drawn with ``random.Random(seed)``).
        seed: the seed of that draw.
        meta: provenance every environment carries (generator, task, snapshot).
        row_meta: more provenance per row (``{"family": ...}`` is always there).
    """
    rows = [r for r in table.to_pylist() if r.get("label") is not None or r.get("soft_label") is not None]
    held = heldout_indices(len(rows), heldout, seed)
    taken: set[str] = set()
    out = []
    for i, row in enumerate(rows):
        label = {k: row.get(k) for k in _LABEL_KEYS}
        label["option_keys"] = list(label["option_keys"])
        out.append(EnvironmentSpec(
            id=_env_id(row["record_id"], row["question_id"], taken), kind="decision",
            instruction=row["instructions_text"],
            question={k: (list(row[k]) if k in ("option_keys", "option_texts") else row[k]) for k in _QUESTION_KEYS},
            verifier=VerifierSpec("rule", {"label": label}), seed=i, split=HOLDOUT_SPLIT if i in held else TRAIN_SPLIT,
            solution=_solution(row),
            meta={**dict(meta or {}), "family": row["family"], **(dict(row_meta(row)) if row_meta else {})}))
    return out


def decision_environments(task: str, *, split: str = "dev", n: int | None = None, heldout: int = 0, seed: int = 0,
                          snapshot_id: str | None = None, home: str | Path | None = None) -> list[EnvironmentSpec]:
    """Questions of an open split of a task snapshot as decision environments with ``rule`` verifiers.

    Args:
        task: the task.
        split: ``train``, ``val`` or ``dev``; test and holdout are refused (their labels never leave the verifier).
        n: how many questions, drawn without replacement with ``numpy.random.default_rng(seed)`` (all when None).
        heldout: how many of them go to split ``heldout``.
        seed: the seed of both draws.
        snapshot_id: the snapshot (default: the task's current one).
        home: the EnvLoop home.

    Raises:
        ValueError: a hidden or unknown split, or a bad ``n``.
    """
    from envloop_pipelines.core.data.snapshots import open_task

    if split in HIDDEN_SPLITS:
        raise ValueError(f"split {split!r} is hidden: its labels are read by the verifier only and never go into an "
                         f"environment dataset; use one of {', '.join(OPEN_SPLITS)}")
    if split not in OPEN_SPLITS:
        raise ValueError(f"unknown split {split!r}; allowed: {', '.join(OPEN_SPLITS)}")
    snapshot = open_task(task, snapshot_id=snapshot_id, home=home)
    table = snapshot.table(split)
    table = table.take(pc.sort_indices(table, sort_keys=[("record_id", "ascending"), ("question_id", "ascending")]))
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= table.num_rows:
            raise ValueError(f"n must be from 1 to the split's {table.num_rows} questions, got {n!r}")
        picked = np.sort(np.random.default_rng(seed).choice(table.num_rows, size=n, replace=False))
        table = table.take(pa.array(picked, pa.int64()))
    return decision_environments_from_table(
        table, heldout=heldout, seed=seed,
        meta={"generator": "decision", "task": task, "snapshot_id": snapshot.snapshot_id, "question_split": split})


def synthesis_dataset_name(task: str, round_key: str) -> str:
    """The dataset a round's synthesized rows are stored as: ``<task>-<round>`` (``personal_agent-r0001``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{task}-{round_key}").strip(".-")[:100]


def synthesis_environments(table: pa.Table, *, task: str, round_key: str) -> list[EnvironmentSpec]:
    """A round's synthesized training rows (``SNAPSHOT_SCHEMA``: with ``provenance``) as decision environments."""
    return decision_environments_from_table(
        table, meta={"generator": "environment_synthesis", "task": task, "round": round_key},
        row_meta=lambda row: {"provenance": json.loads(row["provenance"])} if row.get("provenance") else {})


def generate_dataset(generator: str, name: str, *, home: str | Path | None = None,
                     **params: Any) -> EnvironmentDataset:
    """Run a generator of :data:`GENERATORS` and store its environments as dataset ``name``.

    Args:
        generator: ``shell`` (params of :func:`shell_environments`) or ``decision`` (of
            :func:`decision_environments`).
        name: the dataset's name.
        home: the EnvLoop home (the task snapshot is read from it too).
        params: the generator's parameters; recorded as the manifest's ``source``.
    """
    if generator == "shell":
        envs = shell_environments(**params)
    elif generator == "decision":
        envs = decision_environments(**params, home=home)
    else:
        raise ValueError(f"unknown generator {generator!r}; allowed: {', '.join(GENERATORS)}")
    source = {"generator": generator, **{k: (list(v) if isinstance(v, tuple) else v) for k, v in params.items()}}
    if generator == "decision":
        source["snapshot_id"] = envs[0].meta["snapshot_id"] if envs else params.get("snapshot_id")
    return store_dataset(name, envs, source=source, home=home)


__all__ = ["GENERATORS", "decision_environments", "decision_environments_from_table", "generate_dataset",
           "heldout_indices", "shell_environments", "synthesis_dataset_name", "synthesis_environments"]
