"""From ``Client.start_round`` to the first asset starting, against ``envloop round start`` locally.

    .venv/bin/python bench/bench_sdk.py [--rounds 3] [--executor in_process|multiprocess]

Remote: starts a real deployment (``mlflow server`` and ``dagster-webserver`` loading this project's
code location, the tiny loop of the tests: 30 users x 3 records, 2 null arms, 2 steps of 128 tokens),
runs its setup once through the SDK, then R rounds: for each, the seconds from calling
``Client.start_round`` (hypothesis check, partition added, run launched over GraphQL) to the first
step of the round's run starting (its step stats: the webserver's run launcher starts a process,
which loads the code location and starts the executor), and the round's wall time.

Local: the same loop with the CLI in a fresh home (one untimed ``envloop round start`` first, so the
benchmark and the noise floor exist), then R times ``envloop round start``: from launching the
command to the first step of its round's run (the local instance's event log; the command imports
the project, runs the cached setup job in process, then the round).

Prints every measurement, the medians and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envloop_pipelines.sdk.client import Client  # noqa: E402
from envloop_pipelines.testing import services  # noqa: E402
from envloop_pipelines.core.progress import configure_command_line  # noqa: E402

ENVLOOP = str(Path(sys.executable).with_name("envloop"))
LOOP_ENV = {"ENVLOOP_BUILTIN_USERS": "30", "ENVLOOP_BUILTIN_RECORDS_PER_USER": "3", "ENVLOOP_NOISE_ARMS": "2",
            "ENVLOOP_N_SYNTHESIZED": "12", "ENVLOOP_RECIPE_OVERRIDES": '{"max_steps": 2, "max_length": 128}'}
LOOP_ARGS = ["--builtin-users", "30", "--builtin-records-per-user", "3", "--noise-arms", "2", "--n-synthesized", "12",
             "--recipe-override", "max_steps=2", "--recipe-override", "max_length=128"]


def remote(root: Path, rounds: int, executor: str) -> list[tuple[float, float]]:
    """(seconds to the first step, seconds for the round) of each round started through the SDK."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVLOOP_")}
    out = []
    with services.mlflow_server(root / "mlflow", f"sqlite:///{root / 'mlflow' / 'mlflow.db'}") as mlflow_url:
        env.update(LOOP_ENV, ENVLOOP_HOME=str(root / "home"), MLFLOW_TRACKING_URI=mlflow_url, ENVLOOP_EXECUTOR=executor)
        with services.dagster_webserver(root, env) as dagster_url:
            client = Client(dagster_url, mlflow_url)
            t0 = time.perf_counter()
            client.setup(progress=False)
            print(f"remote setup: {time.perf_counter() - t0:.1f}s")
            for _ in range(rounds):
                t0 = time.perf_counter()
                launched = client.start_round()
                run = client.wait(launched.run_id, progress=False, poll_s=0.5)
                first = run.first_step_start - launched.launched_at
                out.append((first, time.perf_counter() - t0))
                print(f"remote {launched.key}: first asset {first:.2f}s after start_round, round {out[-1][1]:.1f}s "
                      f"({run.status})")
    return out


def local(root: Path, rounds: int) -> list[tuple[float, float]]:
    """(seconds to the first step, seconds for the command) of each ``envloop round start`` here."""
    import dagster as dg

    env = {k: v for k, v in os.environ.items() if not k.startswith("ENVLOOP_") and k not in ("DAGSTER_HOME", "MLFLOW_TRACKING_URI")}
    env.update(ENVLOOP_HOME=str(root / "home"), ENVLOOP_PROGRESS="off")
    dagster_home = root / "home" / "dagster"
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    subprocess.run([ENVLOOP, "round", "start", *LOOP_ARGS], env=env, check=True, capture_output=True, cwd=root)
    print(f"local setup + first round (untimed): {time.perf_counter() - t0:.1f}s")
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    out = []
    for _ in range(rounds):
        launched = time.time()
        t0 = time.perf_counter()
        subprocess.run([ENVLOOP, "round", "start", *LOOP_ARGS], env=env, check=True, capture_output=True, cwd=root)
        total = time.perf_counter() - t0
        with dg.DagsterInstance.get() as instance:
            [run] = instance.get_runs(filters=dg.RunsFilter(job_name="round_job"), limit=1)
            starts = instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.STEP_START).records
            first = min(r.event_log_entry.timestamp for r in starts) - launched
        out.append((first, total))
        print(f"local {run.tags.get('dagster/partition')}: first asset {first:.2f}s after launching the command, "
              f"command {total:.1f}s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--executor", choices=("in_process", "multiprocess"), default="in_process",
                        help="ENVLOOP_EXECUTOR of the deployment")
    args = parser.parse_args()
    configure_command_line()  # progress: a bar on a terminal, lines elsewhere (ENVLOOP_PROGRESS)
    root = Path(tempfile.mkdtemp(prefix="bench-sdk-"))
    far = remote(root / "remote", args.rounds, args.executor)
    near = local(root / "local", args.rounds)
    r_first, l_first = statistics.median(f for f, _ in far), statistics.median(f for f, _ in near)
    r_total, l_total = statistics.median(t for _, t in far), statistics.median(t for _, t in near)
    print(f"\nmedian of {args.rounds}: to the first asset: Client.start_round {r_first:.2f}s, "
          f"envloop round start {l_first:.2f}s (ratio {r_first / l_first:.2f}); "
          f"whole round: remote ({args.executor}) {r_total:.1f}s, local command {l_total:.1f}s")


if __name__ == "__main__":
    from envloop_pipelines.console import quiet_third_party

    quiet_third_party()  # the bench prints what it measures, not a library's notes on itself
    main()
