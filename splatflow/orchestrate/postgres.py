"""A PostgreSQL server of our own for the shared Prefect and MLflow stores (``splatflow serve --shared``).

Debian's ``postgresql`` package (``apt-get install postgresql``) provides the binaries under
``/usr/lib/postgresql/<version>/bin``; we run a cluster in a folder we choose (``initdb``, then ``postgres -D``), on
the address and port the user names, instead of the system's cluster, so nothing needs root or systemd.  The
server refuses to run as root: then its folder belongs to the ``postgres`` system user and its binaries run as
that user (``runuser``).  One role (``splatflow``) with a password from ``SPLATFLOW_PG_PASSWORD`` or generated
once and kept (mode 0600) next to the cluster; TCP clients authenticate with it (scram-sha-256).
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from splatflow.pipeline.errors import UserError
from splatflow.orchestrate.servers import port_in_use

ROLE = "splatflow"
DATABASES = ("prefect", "mlflow")


class PostgresError(UserError):
    """PostgreSQL is missing or would not start: the message says what to install or change."""


def bindir() -> Optional[Path]:
    """The folder of ``initdb``/``postgres``: ``pg_config --bindir``, else the newest Debian
    ``/usr/lib/postgresql/*/bin``, else wherever ``initdb`` is on PATH; None when PostgreSQL is not installed."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4])
                   if Path(p).parts[4].isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    exe = shutil.which("initdb")
    return Path(exe).resolve().parent if exe else None


def missing_reason() -> Optional[str]:
    """Why a cluster cannot be run here, or None."""
    if bindir() is None:
        return "PostgreSQL is not installed (Debian: `apt-get install postgresql`)"
    if os.geteuid() == 0:
        import pwd

        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the server as"
    return None


def _as_server_user(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


def _give_to_server_user(path: Path) -> None:
    if os.geteuid() == 0:
        import pwd

        pw = pwd.getpwnam("postgres")
        os.chown(path, pw.pw_uid, pw.pw_gid)


@dataclass
class Cluster:
    data: Path
    host: str
    port: int
    password: str
    proc: Optional[subprocess.Popen] = None
    log: Optional[Path] = None

    def url(self, database: str, driver: str = "") -> str:
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{ROLE}:{self.password}@{self.host}:{self.port}/{database}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """Fast shutdown (SIGINT: the server ends its sessions and checkpoints), SIGKILL after ``grace_s``."""
        if not self.alive():
            return
        import signal

        with _suppress():
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with _suppress():
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _suppress():
    import contextlib

    return contextlib.suppress(OSError)


def password_for(state: Path) -> str:
    """``SPLATFLOW_PG_PASSWORD``, else the one kept in ``state/postgres.password`` (made on first use, mode 0600)."""
    env = os.environ.get("SPLATFLOW_PG_PASSWORD")
    if env:
        return env
    path = state / "postgres.password"
    if not path.exists():
        state.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(24))
    return path.read_text().strip()


def start(data: Path, *, host: str = "127.0.0.1", port: int = 5432, password: str,
          log: Optional[Path] = None, timeout_s: float = 120.0) -> Cluster:
    """Initialise ``data`` when it holds no cluster yet, start the server on ``host:port`` and make the databases
    of :data:`DATABASES`; returns when it accepts connections."""
    why = missing_reason()
    if why:
        raise PostgresError(f"cannot run PostgreSQL for the shared stores: {why}")
    bins = bindir()
    data = Path(data).resolve()
    if not (data / "PG_VERSION").exists():
        data.mkdir(parents=True, exist_ok=True)
        _give_to_server_user(data)
        os.chmod(data, 0o700)
        pwfile = data.parent / f".{data.name}.initdb.pw"  # initdb wants the data folder empty
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(password + "\n")
        _give_to_server_user(pwfile)
        try:
            p = subprocess.run(_as_server_user([str(bins / "initdb"), "-D", str(data), "-U", ROLE, "--pwfile",
                                                str(pwfile), "--auth-local=trust", "--auth-host=scram-sha-256",
                                                "-E", "UTF8", "--locale=C.UTF-8"]),
                               capture_output=True, text=True)
        finally:
            pwfile.unlink(missing_ok=True)
        if p.returncode != 0:
            raise PostgresError(f"initdb of {data} failed: {(p.stderr or p.stdout).strip()[-1500:]}; if the "
                                f"folder's parents are not readable by the `postgres` user, choose another "
                                f"--state-dir")
    if port_in_use(port, host):
        raise PostgresError(f"port {port} on {host} is in use: stop what runs there or pass another --pg-port")
    log = Path(log or data.parent / "postgres.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    fh = open(log, "ab")
    try:
        proc = subprocess.Popen(_as_server_user([str(bins / "postgres"), "-D", str(data), "-h", host, "-p",
                                                 str(port), "-k", str(data)]),
                                stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        fh.close()
    cluster = Cluster(data, host, port, password, proc, log)
    env = {**os.environ, "PGPASSWORD": password}
    t0 = time.monotonic()
    while True:
        if not cluster.alive():
            raise PostgresError(f"PostgreSQL exited ({proc.returncode}); log {log}:\n"
                                + "\n".join(log.read_text(errors="replace").splitlines()[-20:]))
        ready = subprocess.run([str(bins / "pg_isready"), "-h", host, "-p", str(port), "-U", ROLE],
                               capture_output=True, env=env)
        if ready.returncode == 0:
            break
        if time.monotonic() - t0 > timeout_s:
            cluster.stop()
            raise PostgresError(f"PostgreSQL not ready on {host}:{port} after {timeout_s:.0f} s; log {log}")
        time.sleep(0.5)
    psql = [str(bins / "psql"), "-h", host, "-p", str(port), "-U", ROLE, "-d", "postgres", "-tA", "-v",
            "ON_ERROR_STOP=1"]
    for db in DATABASES:
        have = subprocess.run([*psql, "-c", f"SELECT 1 FROM pg_database WHERE datname = '{db}'"],
                              capture_output=True, text=True, env=env)
        if have.stdout.strip() != "1":
            made = subprocess.run([*psql, "-c", f'CREATE DATABASE "{db}"'], capture_output=True, text=True, env=env)
            if made.returncode != 0:
                cluster.stop()
                raise PostgresError(f"creating database {db} failed: {made.stderr.strip()}")
    return cluster
