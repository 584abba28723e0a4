"""Verifier throughput and sandbox overhead, measured side by side in one run.

    .venv/bin/python bench/bench_verifier.py [--items 20000] [--repeats 3] [--calls 20]

Prints:
  * sandbox start overhead per call: ``/bin/true`` and ``python -c pass`` run
    plainly (``subprocess.run``) and in the local sandbox, and their ratio;
  * verifier throughput (items/s) for the rule verifier in process (parse +
    score) and in a sandboxed worker (the whole ``VerifierRunner.run``:
    labels to Parquet, the worker's imports, scoring, the report back over the
    result channel), for a small and a large predictions file, and the
    sandboxed / in-process time ratio.

Synthetic data: records with a choice (4 options), a noul and a score (5
levels) question, 10% of score questions soft-labelled; predictions are
Dirichlet draws. Timings are medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from envloop_pipelines.core.sandbox import LocalSandbox, SandboxLimits, probe_host
from envloop_pipelines.core.data.snapshots import HIDDEN_LABEL_COLUMNS
from envloop_pipelines.core.verify.protocol import parse_predictions, write_predictions
from envloop_pipelines.core.verify.rule import RuleVerifier
from envloop_pipelines.core.verify.runner import VerifierRunner
from envloop_pipelines.core.progress import configure_command_line


def synthetic(n_items: int, seed: int = 0) -> tuple[pa.Table, list[dict]]:
    rng = np.random.default_rng(seed)
    shapes = [("route", "choice", ["billing", "shipping", "account", "other"]), ("refund", "noul", ["true", "false"]),
              ("urgency", "score", ["0", "1", "2", "3", "4"])]
    cols: dict[str, list] = {c: [] for c in HIDDEN_LABEL_COLUMNS}
    preds = []
    for i in range(n_items):
        family, qtype, keys = shapes[i % 3]
        rid = f"r{i // 3:07d}"
        k = len(keys)
        soft = None
        if qtype == "score" and rng.random() < 0.1:
            soft = rng.dirichlet(np.ones(k)).tolist()
        cols["record_id"].append(rid)
        cols["question_id"].append(family)
        cols["family"].append(family)
        cols["type"].append(qtype)
        cols["option_keys"].append(keys)
        cols["label"].append(int(rng.integers(k)))
        cols["soft_label"].append(soft)
        preds.append({"record_id": rid, "question_id": family, "option_keys": keys, "probs": rng.dirichlet(np.ones(k)).tolist()})
    schema = pa.schema([("record_id", pa.string()), ("question_id", pa.string()), ("family", pa.string()),
                        ("type", pa.string()), ("option_keys", pa.list_(pa.string())), ("label", pa.int32()),
                        ("soft_label", pa.list_(pa.float64()))])
    return pa.table(cols, schema=schema), preds


def median_time(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--small", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)

    support = probe_host()
    print(f"host: root={support.root} netns={support.network_namespace} mountns={support.mount_namespace} "
          f"setuid={support.setuid} python={sys.version.split()[0]}")

    box = LocalSandbox(SandboxLimits(wall_s=30, mem_mb=1024))
    print(f"\nsandbox start overhead per call (mean of {args.calls} calls)")
    print(f"{'command':<18} {'plain ms':>9} {'sandboxed ms':>13} {'overhead ms':>12} {'ratio':>6}")
    for label, argv in (("/bin/true", ["/bin/true"]), ("python -c pass", [sys.executable, "-c", "pass"])):
        plain = median_time(lambda: [subprocess.run(argv, check=True) for _ in range(args.calls)], 1) / args.calls
        boxed = median_time(lambda: [box.run(argv) for _ in range(args.calls)], 1) / args.calls
        print(f"{label:<18} {plain * 1e3:>9.1f} {boxed * 1e3:>13.1f} {(boxed - plain) * 1e3:>12.1f} {boxed / plain:>6.1f}x")

    runner = VerifierRunner()
    print(f"\nrule verifier throughput (median of {args.repeats})")
    print(f"{'items':>7} {'in-process s':>13} {'items/s':>10} {'sandboxed s':>12} {'items/s':>10} "
          f"{'worker s':>9} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in (args.small, args.items):
            labels, preds = synthetic(n)
            path = write_predictions(Path(tmp) / f"preds-{n}.parquet", preds)
            data = path.read_bytes()

            def in_process() -> object:
                return RuleVerifier().score(parse_predictions(data, "parquet"), labels)

            worker_times: list[float] = []

            def sandboxed() -> object:
                run = runner.run(path, labels)
                if not run.ok:
                    raise SystemExit(f"sandboxed run failed: {run.error}\n{run.sandbox.stderr_tail}")
                worker_times.append(run.elapsed_s or 0.0)
                return run

            local_report = in_process()
            boxed_report = sandboxed().report  # type: ignore[attr-defined]
            assert boxed_report.items == local_report.items, "sandboxed and in-process scores differ"  # type: ignore[attr-defined]
            t_local = median_time(in_process, args.repeats)
            t_boxed = median_time(sandboxed, args.repeats)
            print(f"{n:>7} {t_local:>13.3f} {n / t_local:>10.0f} {t_boxed:>12.3f} {n / t_boxed:>10.0f} "
                  f"{statistics.median(worker_times):>9.3f} {t_boxed / t_local:>6.1f}x")
    print("\nratio = sandboxed time / in-process time; 'worker s' is the worker's own time from start to report "
          "(its imports of numpy/scipy/pyarrow included).")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
