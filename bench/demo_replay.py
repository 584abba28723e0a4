"""Replay the README's demo on a source tree with the loop's seed draws pinned, to compare two trees' figures.

A refactor must not move the demo's decisions or figures (issue 36). The demo is deterministic but for one
thing: each hypothesis draws its seeds from the OS's randomness at registration (``draw_seeds``, rule 1:
unknown before the hypothesis is written), so two runs train different candidates. This script runs
``envloop demo`` on ``--tree`` (a checkout; the installed package's dependencies are used) in a fresh home with
``secrets.randbelow`` replaced, in every process of the run, by a ``random.Random(--seed)`` sequence (a
``sitecustomize`` module on ``PYTHONPATH``, here only: the product never pins a draw). It prints the demo's
output (stdout) and writes it to ``--out`` (stderr beside it); run it on two trees and compare the round lines and the release table
(``--compare A B`` prints the lines that differ, seconds masked).

    python bench/demo_replay.py --tree /path/to/before --out before.txt
    python bench/demo_replay.py --tree . --out after.txt
    python bench/demo_replay.py --compare before.txt after.txt

Seconds differ from run to run; the lever a round proposes depends on the measured seconds per step (the
demo's compute cap), so run both with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SITECUSTOMIZE = '''\
import os
import random
import secrets

_draws = random.Random(int(os.environ["ENVLOOP_REPLAY_SEED"]))
secrets.randbelow = lambda n: _draws.randrange(n)  # bench/demo_replay.py: the same seed draws in both runs
'''
#: What differs between two runs and is no figure: seconds, the loop's id (a clock reading), paths.
MASKS = [(re.compile(r"\b\d+(\.\d+)?s\b"), "<s>"), (re.compile(r"(timings|demo finished).*"), r"\1 <masked>"),
         (re.compile(r"/tmp/\S+"), "<path>"), (re.compile(r"\bcli-\d+"), "cli-<id>")]


def replay(tree: Path, seed: int, out: Path) -> int:
    with tempfile.TemporaryDirectory(prefix="demo-replay-") as tmp:
        pin = Path(tmp) / "pin"
        pin.mkdir()
        (pin / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ENVLOOP_", "DAGSTER_", "MLFLOW_"))}
        env.update(PYTHONPATH=f"{tree.resolve()}{os.pathsep}{pin}", ENVLOOP_REPLAY_SEED=str(seed),
                   ENVLOOP_HOME=str(Path(tmp) / "home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        envloop = [sys.executable, "-c", "from envloop_pipelines.cli import main; main()", "demo"]
        done = subprocess.run(envloop, env=env, cwd=tmp, capture_output=True, text=True)
    out.write_text(done.stdout, encoding="utf-8")
    out.with_name(out.name + ".stderr").write_text(done.stderr, encoding="utf-8")
    print(done.stdout, end="")
    print(done.stderr[-3000:], end="", file=sys.stderr)
    return done.returncode


def figures(path: Path) -> list[str]:
    """The demo's printed lines (its stdout: progress bars go to stderr), masked (:data:`MASKS`)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if re.match(r"[\w ]+:\s+\d+% ", line) or line.startswith("WARNING") or not line.strip():
            continue  # a progress line or a log line, if the file holds stderr too
        for pattern, repl in MASKS:
            line = pattern.sub(repl, line)
        lines.append(line)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--seed", type=int, default=36)
    parser.add_argument("--out", type=Path, default=Path("demo-replay.txt"))
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    args = parser.parse_args()
    if args.compare:
        a, b = (figures(p) for p in args.compare)
        differ = [(x, y) for x, y in zip(a, b) if x != y] + [(x, "") for x in a[len(b):]] + [("", y) for y in b[len(a):]]
        for x, y in differ:
            print(f"- {x}\n+ {y}")
        print(f"{len(differ)} of {max(len(a), len(b))} lines differ (seconds, paths, the loop id and the timings line masked)")
        return 1 if differ else 0
    return replay(args.tree, args.seed, args.out)


if __name__ == "__main__":
    sys.exit(main())
