"""The built-in benchmark as a task: generated to JSONL, then imported through the same path as a user's file.

Here, above the data layer, so that ``core/data`` never imports the benchmark generator that stands on it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from envloop_pipelines.core.benchmark.generator import BUILTIN_HIDDEN_USERS, BenchmarkConfig, generate_benchmark, write_jsonl
from envloop_pipelines.core.data.datasets import import_file
from envloop_pipelines.core.storage import envloop_home


def builtin_config(*, n_users: int | None = None, records_per_user: int | None = None, seed: int = 0,
                   hidden_users: int | None = None) -> Any:
    """The built-in benchmark's config for the sizes chosen (``None``: the default).

    Without a chosen number of users it is the default benchmark, whose test and holdout are sized
    for a gate with power (``BUILTIN_HIDDEN_USERS`` users each; train, val and dev are those of the
    default 240 users). A chosen number of users keeps every split at its fraction of them, unless
    ``hidden_users`` sets the users of test and holdout (unseen users added after ``n_users``).
    """
    from dataclasses import replace

    if hidden_users is None and n_users is None:
        hidden_users = BUILTIN_HIDDEN_USERS
    config = BenchmarkConfig(seed=seed, hidden_users=hidden_users)
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
    hidden_users: int | None = None,
    out: str | Path | None = None,
    do_import: bool = True,
    home: str | Path | None = None,
) -> dict[str, Any]:
    """Generate the built-in benchmark to JSONL and import it through the same path as user data.

    Returns a dict with the JSONL path, its sha256, record count, timings and
    (when imported) the snapshot summary.
    """
    config = builtin_config(n_users=n_users, records_per_user=records_per_user, seed=seed, hidden_users=hidden_users)
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
