"""A real PostgreSQL server on loopback for the tests: Debian's binaries, a throwaway cluster.

``.ci/run`` installs the ``postgresql`` package (Debian); locally the tests skip
without it unless ``ENVLOOP_REQUIRE_POSTGRES=1`` (set by ``.ci/run``) turns
the skip into a failure, so CI can never pass by skipping.

PostgreSQL refuses to run as root, so when the tests run as root the cluster
belongs to the ``postgres`` system user the package creates.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from envloop_pipelines.testing.services import free_port

REQUIRE_ENV = "ENVLOOP_REQUIRE_POSTGRES"
USER = "envloop"
PASSWORD = "envloop-test-password"


def postgres_bindir() -> Path | None:
    """Debian's versioned bin directory (``/usr/lib/postgresql/<v>/bin``), or wherever ``initdb`` is on PATH."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    if candidates:
        return Path(candidates[-1]).parent
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def require_postgres() -> Path:
    """The bin directory, or skip (fail under ``ENVLOOP_REQUIRE_POSTGRES=1``)."""
    bindir = postgres_bindir()
    if bindir is None:
        message = "PostgreSQL server binaries not found (Debian: apt-get install postgresql)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message}; {REQUIRE_ENV}=1 requires them")
        pytest.skip(message)
    return bindir


@dataclass
class PostgresServer:
    """A running cluster: ``url(db)`` for SQLAlchemy/MLflow, the parts for Dagster's ``postgres_db`` block."""

    root: Path
    bindir: Path
    port: int
    host: str = "127.0.0.1"
    user: str = USER
    password: str = PASSWORD

    def url(self, db: str) -> str:
        return f"postgresql://{self.user}:{self.password}@{self.host}:{self.port}/{db}"

    def connect(self, db: str):
        import psycopg2

        return psycopg2.connect(host=self.host, port=self.port, user=self.user, password=self.password, dbname=db)

    def create_database(self, name: str) -> str:
        conn = self.connect("postgres")
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return name

    def query(self, db: str, sql: str, params: tuple = ()) -> list[tuple]:
        conn = self.connect(db)
        try:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                return cur.fetchall()
        finally:
            conn.close()

    def stop(self) -> None:
        _as_owner([str(self.bindir / "pg_ctl"), "-D", str(self.root / "data"), "-m", "fast", "-w", "stop"],
                  check=False)
        shutil.rmtree(self.root, ignore_errors=True)


def _owner() -> pwd.struct_passwd | None:
    """The system user that owns the cluster when we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        pytest.fail("running as root and there is no 'postgres' user to own the cluster")


def _as_owner(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    owner = _owner()
    kwargs = {}
    if owner is not None:
        kwargs = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, **kwargs)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} failed ({proc.returncode}): {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc


def start_postgres() -> PostgresServer:
    """initdb a fresh cluster in a temp dir and start it on a free loopback port (password auth over TCP)."""
    bindir = require_postgres()
    root = Path(tempfile.mkdtemp(prefix="envloop-pg-"))
    owner = _owner()
    if owner is not None:
        os.chown(root, owner.pw_uid, owner.pw_gid)
    pwfile = root / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if owner is not None:
        os.chown(pwfile, owner.pw_uid, owner.pw_gid)
    _as_owner([str(bindir / "initdb"), "-D", str(root / "data"), "-U", USER, f"--pwfile={pwfile}",
               "--auth-host=scram-sha-256", "--auth-local=trust", "-E", "UTF8", "--locale=C.UTF-8"])
    port = free_port()
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off -c max_connections=100"
    _as_owner([str(bindir / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "server.log"), "-o", options,
               "-w", "-t", "60", "start"])
    server = PostgresServer(root=root, bindir=bindir, port=port)
    deadline = time.time() + 30
    while True:
        try:
            server.query("postgres", "SELECT 1")
            return server
        except Exception:  # noqa: BLE001 - retried until the deadline
            if time.time() > deadline:
                log = (root / "server.log").read_text(errors="replace")[-2000:]
                server.stop()
                raise RuntimeError(f"postgres did not accept connections: {log}") from None
            time.sleep(0.3)
