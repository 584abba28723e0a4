"""Data layer: built-in benchmark size, generation and import time, validation throughput.

Run: .venv/bin/python bench/bench_data.py
Prints the default benchmark's sizes, the time to generate and import it (the
README's main job), and the validator's records/s against plain ``json.loads``
on the same file, as a ratio (the price of full validation).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from envloop_pipelines.core.benchmark import BenchmarkConfig
from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task
from envloop_pipelines.core.data.jsonl import load_jsonl
from envloop_pipelines.core.progress import configure_command_line


def main() -> None:
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    with tempfile.TemporaryDirectory() as tmp:
        for label, scale in (("default", 1), ("x4", 4)):
            cfg = BenchmarkConfig().scaled(scale)
            result = generate_builtin_task(task=f"pa_{label}", n_users=cfg.n_users,
                                           records_per_user=cfg.records_per_user, home=tmp)
            splits = result["summary"]["splits"]
            questions = sum(s["questions"] for s in splits.values())
            print(f"[{label}] users={cfg.n_users} records={result['records']} questions={questions} "
                  f"file={Path(result['path']).stat().st_size / 1e6:.1f}MB "
                  f"generate={result['generate_s']:.2f}s import={result['import_s']:.2f}s")
            print("    questions per split: " + ", ".join(f"{k}={v['questions']}" for k, v in splits.items()))
            path = Path(result["path"])
            started = time.perf_counter()
            for line in path.read_text(encoding="utf-8").splitlines():
                json.loads(line)
            raw_s = time.perf_counter() - started
            started = time.perf_counter()
            load_jsonl(path, require_group=True)
            val_s = time.perf_counter() - started
            n = result["records"]
            print(f"    validation: {n / val_s:,.0f} records/s (with token budget) vs json.loads {n / raw_s:,.0f} "
                  f"records/s -> ratio {raw_s / val_s:.2f}")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
