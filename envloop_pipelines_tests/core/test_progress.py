"""Progress of long work: a bar on a pseudo-terminal, lines every few percent or 30 s in plain logs, and in Dagster.

The terminal case runs the real ``envloop`` command in a pseudo-terminal (``pty``), the way a
person sees it; the log case runs it with stderr on a pipe, the way CI and log files see it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from envloop_pipelines.core import progress
from envloop_pipelines.core.progress import Figures, Progress, track

ENVLOOP = str(Path(sys.executable).with_name("envloop"))
#: A plain progress line: ``generate:  45% 450/1000 user [00:01<00:01, 366.68 user/s]``.
LINE = re.compile(r"^(?P<desc>[a-z ]+): +(?P<pct>\d+)% (?P<n>\d+)/(?P<total>\d+) (?P<unit>\w+) "
                  r"\[(?P<elapsed>\d\d:\d\d)<(?P<eta>\d\d:\d\d), (?P<rate>[\d.]+) (?P=unit)/s\]( .*)?$")


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def log_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.MODE_ENV, "log")


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == progress.LOGGER]


# --------------------------------------------------------------------------- the figures


def test_a_line_carries_counts_percent_elapsed_eta_and_rate() -> None:
    f = Figures("train", "step", 8, 20, 12.0, {"loss": 0.693147})
    assert f.rate == pytest.approx(8 / 12) and f.eta_s == pytest.approx(18.0)
    assert f.line() == "train:  40% 8/20 step [00:12<00:18, 0.67 step/s] loss=0.6931"
    assert LINE.match(f.line())
    assert Figures("import", "record", 5, None, 2.0, {}).line() == "import: 5 record [00:02, 2.50 record/s]"
    assert Figures("round r0001", "step", 1, 8, 3725.0, {}).line().startswith("round r0001:  12% 1/8 step [1:02:05<")


# --------------------------------------------------------------------------- cadence in plain logs


def test_plain_logs_get_a_line_every_five_percent(log_mode: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=progress.LOGGER)
    clock = FakeClock()
    with Progress("predict", total=200, unit="q", clock=clock) as bar:
        for _ in range(200):
            clock.t += 0.125  # 25 s in all
            bar.update(1)
    lines = _lines(caplog)
    pcts = [int(LINE.match(line)["pct"]) for line in lines]
    # nothing in the first second (8 questions, 4%), then one line per 5% mark, the last at 100%
    assert pcts == list(range(5, 101, 5))
    assert lines[0] == "predict:   5% 10/200 q [00:01<00:24, 8.00 q/s]"
    assert lines[-1] == "predict: 100% 200/200 q [00:25<00:00, 8.00 q/s]"


def test_plain_logs_get_a_line_every_30_s_when_the_percent_moves_slowly(log_mode: None,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=progress.LOGGER)
    clock = FakeClock()
    bar = Progress("train", total=1000, unit="step", clock=clock)
    for _ in range(40):  # 40 steps of 10 s: 4% of the work in 400 s
        clock.t += 10.0
        bar.update(1, loss=0.5)
    lines = _lines(caplog)
    assert len(lines) == 40 // 3  # one per 30 s (every third step)
    assert lines[0] == "train:   0% 3/1000 step [00:30<2:46:10, 0.10 step/s] loss=0.5"
    bar.close()
    assert _lines(caplog)[-1].startswith("train:   4% 40/1000 step [06:40<")


def test_short_work_says_nothing_and_an_unknown_total_still_reports(log_mode: None,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=progress.LOGGER)
    assert list(track(range(50), "quick")) == list(range(50))
    assert _lines(caplog) == []
    clock = FakeClock()
    with Progress("import", unit="record", clock=clock) as bar:
        for _ in range(7):
            clock.t += 10.0
            bar.update(100)
    assert _lines(caplog) == ["import: 300 record [00:30, 10.00 record/s]", "import: 600 record [01:00, 10.00 record/s]",
                              "import: 700 record [01:10, 10.00 record/s]"]


def test_off_mode_and_bad_values(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=progress.LOGGER)
    monkeypatch.setenv(progress.MODE_ENV, "off")
    clock = FakeClock()
    with Progress("x", total=2, clock=clock) as bar:
        clock.t += 60
        bar.update(2)
    assert _lines(caplog) == []
    monkeypatch.setenv(progress.MODE_ENV, "loud")
    with pytest.raises(ValueError, match="ENVLOOP_PROGRESS='loud' is not a progress mode; allowed: auto, bar, log, off"):
        Progress("x", total=2)
    monkeypatch.setenv(progress.MODE_ENV, "log")
    with pytest.raises(ValueError, match="total must be ≥ 0"):
        Progress("x", total=-1)


# --------------------------------------------------------------------------- the real command: terminal and logs

#: About 3 s of generating: long enough for a bar and for lines every few percent.
GENERATE = [ENVLOOP, "data", "generate", "--users", "3000", "--records-per-user", "2", "--no-import"]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "ENVLOOP_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env.pop("COLUMNS", None)
    env.pop(progress.MODE_ENV, None)
    return env


@pytest.mark.parametrize("columns", [100, 0], ids=["100 columns", "no size reported"])
def test_a_terminal_gets_a_bar_with_rate_and_eta(tmp_path: Path, columns: int) -> None:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(GENERATE, stdin=slave, stdout=slave, stderr=slave, env=_env(tmp_path), close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, out.decode(errors="replace")[-2000:]
    text = out.decode("utf-8", errors="replace")
    frames = [f for f in re.split(r"[\r\n]+", text) if f.startswith("generate:")]
    # tqdm redraws one line in place: "generate:  41%|████      | 615/1500 [00:01<00:02, 366.42user/s]"
    assert "\r" in text
    bars = [f for f in frames if re.search(r"\d+%\|.*\| \d+/3000 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+ ?user/s\]", f)]
    assert len(bars) >= 2, frames
    assert bars[-1].startswith("generate: 100%|")
    assert not any(LINE.match(f) for f in frames), "no plain log lines on a terminal, only the bar"
    assert "wrote 6000 records" in text


def test_plain_logs_of_the_command_get_lines_every_few_percent(tmp_path: Path) -> None:
    done = subprocess.run(GENERATE, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert lines and all(LINE.match(line) for line in lines), lines
    pcts = [int(LINE.match(line)["pct"]) for line in lines]
    assert pcts == sorted(pcts) and pcts[-1] == 100 and len(set(pcts)) == len(pcts)
    # the first line once the work has run a second, then one per 5% mark: not a line per user
    assert all(b - a >= 5 for a, b in zip(pcts[1:], pcts[2:])) and len(pcts) <= 21, pcts
    assert all(LINE.match(line)["unit"] == "user" and LINE.match(line)["total"] == "3000" for line in lines)
    assert "\r" not in done.stderr and "|" not in done.stderr  # no bar in a log
    assert done.stdout.startswith("wrote 6000 records")  # stdout keeps the command's own output


# --------------------------------------------------------------------------- in a Dagster run


def test_a_dagster_run_keeps_the_progress_lines_in_its_event_log(log_mode: None) -> None:
    import dagster as dg
    import yaml

    from envloop_pipelines.sdk.instance import INSTANCE_FILE

    @dg.asset
    def slow_work() -> None:
        clock = FakeClock()
        with Progress("train", total=4, unit="step", clock=clock) as bar:
            for _ in range(4):
                clock.t += 2.0
                bar.update(1, loss=0.25)

    settings = {"python_logs": yaml.safe_load(INSTANCE_FILE.read_text())["python_logs"]}  # the shipped instance file
    with dg.instance_for_test(overrides=settings) as instance:
        result = dg.materialize([slow_work], instance=instance)
        assert result.success
        messages = [e.user_message for e in instance.all_logs(result.run_id) if e.user_message.startswith("train:")]
    assert messages == [f"train: {25 * i:3d}% {i}/4 step [00:{2 * i:02d}<00:{8 - 2 * i:02d}, 0.50 step/s] loss=0.25"
                        for i in range(1, 5)]


# --------------------------------------------------------------------------- training


@pytest.mark.slow
def test_training_reports_its_steps_with_the_loss(tmp_path: Path, log_mode: None, caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from envloop_pipelines.testing.serve import build_checkpoint

    caplog.set_level(logging.INFO, logger=progress.LOGGER)
    # Two steps on the cached frozen layers can end within QUIET_S (1 s), and such work logs nothing by design:
    # no quiet time here, so the test does not depend on the machine's speed.
    monkeypatch.setitem(progress.Progress.__init__.__kwdefaults__, "quiet_s", 0.0)
    build_checkpoint(tmp_path / "ckpt", max_steps=2)
    lines = [line for line in _lines(caplog) if line.startswith("train:")]
    assert lines, _lines(caplog)
    last = LINE.match(lines[-1])
    assert last and last["pct"] == "100" and last["n"] == last["total"] == "2" and last["unit"] == "step"
    assert re.search(r" loss=[\d.]+$", lines[-1])
