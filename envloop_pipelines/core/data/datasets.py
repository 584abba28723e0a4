"""Use cases of the data layer: import a user's file, build the built-in benchmark task."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from envloop_pipelines.core.data.records import DEFAULT_GROUP_KEY, DEFAULT_TOKEN_BUDGET
from envloop_pipelines.core.data.snapshots import TaskSnapshot, create_snapshot
from envloop_pipelines.core.data.splits import SplitFractions
from envloop_pipelines.core.storage import envloop_home, sha256_file
from envloop_pipelines.core.data.tabular import ColumnMapping, load_records


def import_file(
    path: str | Path,
    task: str,
    *,
    mapping: ColumnMapping | None = None,
    fractions: SplitFractions = SplitFractions(),
    seed: int = 0,
    group_key: str = DEFAULT_GROUP_KEY,
    token_budget: int | None = DEFAULT_TOKEN_BUDGET,
    home: str | Path | None = None,
    extra: dict[str, Any] | None = None,
) -> TaskSnapshot:
    """Validate a whole file, then publish it as a new snapshot of ``task``.

    Raises:
        DataValidationError: every error in the file; nothing was written.
    """
    path = Path(path)
    report = load_records(path, mapping=mapping, require_group=True, token_budget=token_budget)
    source = {
        "path": str(path.resolve()),
        "sha256": sha256_file(path),
        "format": path.suffix.lower().lstrip("."),
        "mapping": None if mapping is None else repr(mapping),
    }
    return create_snapshot(report.records, task, source=source, fractions=fractions, seed=seed,
                           group_key=group_key, home=home, extra=extra)


def builtin_config(*, n_users: int | None = None, records_per_user: int | None = None, seed: int = 0) -> Any:
    """The built-in benchmark's config for the sizes chosen (``None``: the default).

    Without a chosen number of users it is the default benchmark, whose test and holdout are sized
    for a gate with power (``BUILTIN_HIDDEN_USERS`` users each; train, val and dev are those of the
    default 240 users). A chosen number of users keeps every split at its fraction of them.
    """
    from dataclasses import replace

    from envloop_pipelines.core.benchmark import BUILTIN_HIDDEN_USERS, BenchmarkConfig

    config = BenchmarkConfig(seed=seed, hidden_users=BUILTIN_HIDDEN_USERS if n_users is None else None)
    if n_users is not None:
        config = replace(config, n_users=n_users)
    if records_per_user is not None:
        config = replace(config, records_per_user=records_per_user)
    return config


def generate_builtin_task(
    *,
    task: str = "personal_agent",
    n_users: int | None = None,
    records_per_user: int | None = None,
    seed: int = 0,
    out: str | Path | None = None,
    do_import: bool = True,
    home: str | Path | None = None,
) -> dict[str, Any]:
    """Generate the built-in benchmark to JSONL and import it through the same path as user data.

    Returns a dict with the JSONL path, its sha256, record count, timings and
    (when imported) the snapshot summary.
    """
    from envloop_pipelines.core.benchmark import generate_benchmark, write_jsonl

    config = builtin_config(n_users=n_users, records_per_user=records_per_user, seed=seed)
    started = time.perf_counter()
    records = generate_benchmark(config)
    hidden = "" if config.hidden_users is None else f"-h{config.hidden_users}"
    path = Path(out) if out else (envloop_home(home) / "generated"
                                  / f"{task}-seed{seed}-u{config.n_users}x{config.records_per_user}{hidden}.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = write_jsonl(records, path)
    result: dict[str, Any] = {
        "path": str(path),
        "sha256": digest,
        "records": len(records),
        "generate_s": time.perf_counter() - started,
    }
    if do_import:
        started = time.perf_counter()
        snapshot = import_file(
            path, task, fractions=config.fractions, seed=seed, home=home,
            extra={"generator": {"name": "personal_agent", "n_users": config.n_users,
                                 "records_per_user": config.records_per_user, "seed": seed,
                                 **({} if config.hidden_users is None else {"hidden_users": config.hidden_users})}},
        )
        result["import_s"] = time.perf_counter() - started
        result["summary"] = snapshot.summary()
    return result
