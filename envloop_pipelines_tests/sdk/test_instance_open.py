"""Doors opened together on a fresh home create the Dagster instance's storages once (issue 47's race test found it).

Two ``LocalClient`` processes that opened a fresh ``$DAGSTER_HOME`` in the same instant both stamped the SQLite
schema version, and every later open failed with alembic's "more than one head present".
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

OPEN = r"""
import sys, time
from pathlib import Path
from envloop_pipelines.sdk.instance import open_instance
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.001)
open_instance().get_runs(limit=1)
print("opened", flush=True)
"""


def test_doors_opening_a_fresh_home_at_once_leave_one_schema_version(tmp_path: Path) -> None:
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "dagster"), "ENVLOOP_HOME": str(tmp_path / "home")}
    go = tmp_path / "go"
    doors = [subprocess.Popen([sys.executable, "-c", OPEN, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    time.sleep(3.0)  # every door imported and waiting
    go.touch()
    for door in doors:
        out, err = door.communicate(timeout=300)
        assert door.returncode == 0 and out.strip() == "opened", err[-2000:]
    for db in sorted((tmp_path / "dagster").rglob("*.db")):
        with sqlite3.connect(db) as conn:
            tables = {r[0] for r in conn.execute("select name from sqlite_master where type='table'")}
            if "alembic_version" in tables:
                rows = conn.execute("select version_num from alembic_version").fetchall()
                assert len(rows) == 1, (db, rows)
    subprocess.run([sys.executable, "-c", "from envloop_pipelines.sdk.instance import open_instance; "
                    "open_instance().get_runs(limit=1)"], env=env, check=True, timeout=300)
