"""Simulated hosts that share nothing but the network, on one machine (tests/test_hosts.py, bench/hosts.py).

What docs/orchestration.md's runbook does on real machines, with loopback for the network:

* an OpenSSH server (Debian's ``sshd``, on a free port, its own host key and ``authorized_keys``) that holds the
  DVC remote, reached as ``ssh://USER@127.0.0.1:PORT/...``;
* ``splatflow serve --shared`` on the server host (its own clone and ``$HOME``): PostgreSQL, Prefect and MLflow on
  it, the DVC remote named by ``--dvc-remote``;
* worker hosts, each with its own clone of the project's bare git remote, its own venv (``pip install --no-deps
  -e`` of that clone, on top of the test venv's site-packages, so no download), its own DVC cache, ``$HOME`` and
  SSH key, joined with ``splatflow worker --server URL``;
* the user's checkout, with its own ``$HOME`` and SSH key, which starts ``splatflow batch --hosts``.

The project is the two-stage toy DVC project of tests/test_tracking.py (real DVC, real tracking, trivial work)
with a copy of the library, so each host's venv runs the library from its own clone.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import yaml

from splatflow.orchestrate import postgres, servers
from tests._project import BIN, init_repo, run
from tests.test_tracking import DVC_YAML, FAKE_STAGE

#: tests/test_tracking.py's two toy stages, their steps read from toy.yaml (params.yaml is the product's).
TOY_DVC_YAML = (DVC_YAML.replace("        - one\n", "        - toy.yaml:\n          - one\n")
                .replace("        - two\n", "        - toy.yaml:\n          - two\n"))

REPO = Path(__file__).resolve().parents[1]
SSHD = Path("/usr/sbin/sshd")
#: Console scripts a host venv needs from the test venv (the host's own ``splatflow`` comes from its clone).
SCRIPTS = ("prefect", "dvc", "mlflow")
TOY_PYPROJECT = textwrap.dedent('''
    [build-system]
    requires = ["setuptools>=68"]
    build-backend = "setuptools.build_meta"

    [project]
    name = "splatflow"
    version = "0.1.0"
    requires-python = ">=3.11"

    [project.scripts]
    splatflow = "splatflow.cli:app"

    [tool.setuptools.packages.find]
    include = ["splatflow*"]
''')


def missing_reason() -> Optional[str]:
    """Why the simulated hosts cannot run here, or None."""
    why = postgres.missing_reason()
    if why:
        return f"PostgreSQL for the shared stores: {why}"
    if not SSHD.exists() or not shutil.which("ssh-keygen"):
        return "OpenSSH server for the DVC remote is not installed (Debian: `apt-get install openssh-server`)"
    return None


def env_for(home: Path, venv_bin: Path = BIN, **extra: str) -> dict:
    """A process of one simulated host: its own $HOME (and so its own Prefect, DVC, MLflow and SSH user state) and
    its own venv first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "SPLATFLOW_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update({"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local"),
                "XDG_CACHE_HOME": str(home / ".cache"), "PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', '')}",
                "PYTHONPATH": "", "OMP_WAIT_POLICY": "PASSIVE", "DO_NOT_TRACK": "1",
                "VIRTUAL_ENV": str(venv_bin.parent),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
                "PREFECT_WORKER_QUERY_SECONDS": "1", "DVC_NO_ANALYTICS": "1", **extra})
    return env


def spawn(cmd: list[str], cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    with open(log, "wb") as fh:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def stop(proc: subprocess.Popen, timeout_s: float = 90) -> None:
    """SIGTERM (the CLI stops what it started), then SIGKILL to the whole process group."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(what: str, check, timeout_s: float, procs=()) -> None:
    t0 = time.monotonic()
    while not check():
        for p, log in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process exited ({p.returncode}):\n{Path(log).read_text()[-4000:]}")
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(0.5)


# --- SSH ------------------------------------------------------------------------------------------------------------

@dataclass
class SSHServer:
    port: int
    user: str
    authorized_keys: Path
    proc: subprocess.Popen
    log: Path

    def url(self, path: Path) -> str:
        return f"ssh://{self.user}@127.0.0.1:{self.port}{Path(path).resolve()}"

    def authorize(self, home: Path) -> None:
        """Give ``home`` an SSH key of its own (``~/.ssh/id_ed25519``, which DVC's SSH remote uses by default) and
        let it in."""
        ssh = home / ".ssh"
        ssh.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = ssh / "id_ed25519"
        if not key.exists():
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", home.name, "-f", str(key)], home)
        with open(self.authorized_keys, "a") as fh:
            fh.write((ssh / "id_ed25519.pub").read_text())


@contextmanager
def ssh_server(folder: Path) -> Iterator[SSHServer]:
    """Debian's sshd on a free loopback port with a host key and ``authorized_keys`` of its own; stopped on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / "host_key")], folder)
    keys = folder / "authorized_keys"
    keys.touch(mode=0o600)
    port = servers.free_port()
    (folder / "sshd_config").write_text(textwrap.dedent(f"""\
        Port {port}
        ListenAddress 127.0.0.1
        HostKey {folder / 'host_key'}
        PidFile {folder / 'sshd.pid'}
        AuthorizedKeysFile {keys}
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        PubkeyAuthentication yes
        PermitRootLogin prohibit-password
        StrictModes no
        UsePAM no
        MaxStartups 50
        Subsystem sftp internal-sftp
        """))
    if os.geteuid() == 0:
        # sshd's privilege-separation folder (Debian's service unit makes it)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    log = folder / "sshd.log"
    proc = spawn([str(SSHD), "-D", "-e", "-f", str(folder / "sshd_config")], folder, dict(os.environ), log)
    try:
        wait_for("sshd", lambda: servers.port_in_use(port), 60, [(proc, log)])
        yield SSHServer(port, getpass.getuser(), keys, proc, log)
    finally:
        stop(proc, 10)


# --- the project and the hosts --------------------------------------------------------------------------------------

def make_user_project(root: Path, origin: Path, scenes: tuple[str, ...]) -> Path:
    """The toy project with a copy of the library (each host installs its own clone's), its raw captures added to
    DVC (the hosts pull them), pushed to the bare git remote ``origin`` the hosts clone from.  Its params.yaml is
    the product's (the CLI checks it) with the toy scenes; the toy stages read their steps from ``toy.yaml``."""
    root.mkdir(parents=True)
    (root / "fake_stage.py").write_text(FAKE_STAGE.replace('open("params.yaml")', 'open("toy.yaml")'))
    (root / "dvc.yaml").write_text(TOY_DVC_YAML)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["base"]["scenes"] = {s: {"source": f"raw/{s}"} for s in scenes}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "toy.yaml").write_text(json.dumps({"one": {"steps": 3}, "two": {"steps": 2}}, indent=1))
    (root / ".gitignore").write_text("/mlflow.db\n/mlartifacts/\n/.splatflow/\n/started\n*.egg-info/\n"
                                     "__pycache__/\n")
    (root / "pyproject.toml").write_text(TOY_PYPROJECT)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "_numba_cache*")
    for d in ("splatflow", "flows"):
        shutil.copytree(REPO / d, root / d, ignore=ignore)
    (root / "stages").mkdir()  # what the CLI recognises a project by (the toy's stage lives in fake_stage.py)
    (root / "stages" / "__init__.py").write_text("")
    init_repo(root, "toy project")
    for s in scenes:  # captures go to DVC, never to git
        (root / "raw" / s).mkdir(parents=True)
        (root / "raw" / s / "capture.txt").write_text(f"scene {s}")
    run([str(BIN / "dvc"), "add", *[f"raw/{s}" for s in scenes]], root)
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "raw captures in DVC"], root)
    run(["git", "init", "-q", "--bare", "--initial-branch=main", str(origin)], root)  # clones check out main
    run(["git", "remote", "add", "origin", str(origin)], root)
    run(["git", "push", "-q", "origin", "HEAD:refs/heads/main"], root)
    return root


def host_venv(venv: Path, clone: Path) -> Path:
    """A venv of the host's own: the test venv's site-packages underneath (a ``.pth`` line: no download, and the
    test venv's own editable splatflow stays out), ``pip install --no-deps -e`` of the host's clone on top, and the
    console scripts of :data:`SCRIPTS` bound to this venv's python.  Returns its ``bin``."""
    if not (venv / "bin" / "python").exists():
        run([sys.executable, "-m", "venv", "--without-pip", str(venv)], venv.parent)
        site = Path(run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                        venv.parent).stdout.strip())
        (site / "_splatflow_base.pth").write_text(sysconfig.get_path("purelib") + "\n")
        for name in SCRIPTS:
            text = (BIN / name).read_text().split("\n", 1)[1]
            script = venv / "bin" / name
            script.write_text(f"#!{venv / 'bin' / 'python'}\n{text}")
            script.chmod(0o755)
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-e", str(clone)], clone, env=env_for(venv.parent / "home"))
    return venv / "bin"


@dataclass
class Team:
    tmp: Path
    state: Path
    user: Path
    user_env: dict
    settings: dict
    server: str
    ssh: SSHServer
    serve: subprocess.Popen
    workers: dict = field(default_factory=dict)

    def start_host(self, name: str, **env: str) -> tuple[Path, subprocess.Popen, Path]:
        """A worker host: a clone of the git remote, its own venv, $HOME, SSH key and DVC cache, joined with
        `splatflow worker --server URL`."""
        clone = self.tmp / name / "clone"
        if not clone.exists():
            run(["git", "clone", "-q", str(self.tmp / "origin.git"), str(clone)], self.tmp)
        venv_bin = host_venv(self.tmp / name / "venv", clone)
        home = self.tmp / name / "home"
        if not (home / ".ssh" / "id_ed25519").exists():
            self.ssh.authorize(home)
        log = self.tmp / f"{name}.log"
        w = spawn([str(venv_bin / "splatflow"), "worker", "--server", self.server, "--clone", str(clone),
                   "--name", name], clone, env_for(home, venv_bin, **env), log)
        self.workers[name] = w
        wait_for(f"worker {name}", lambda: "DVC remote" in log.read_text(), 180, [(w, log)])
        return clone, w, log

    def batch(self, *scenes: str, max_concurrent: int = 2, timeout_s: float = 1200) -> subprocess.CompletedProcess:
        return run([str(BIN / "splatflow"), "batch", "--hosts", *scenes, "--max-concurrent", str(max_concurrent)],
                   self.user, env=self.user_env, check=False, timeout=timeout_s)

    def stop_workers(self) -> None:
        for w in self.workers.values():
            stop(w)
        self.workers.clear()


@contextmanager
def team(tmp: Path, scenes: tuple[str, ...]) -> Iterator[Team]:
    """An SSH server, ``splatflow serve --shared`` on free loopback ports, and the user's checkout set up as the
    runbook says (the shared addresses in its config file, the SSH DVC remote, the raw captures pushed).  Every
    server and worker is stopped on exit, also on failure."""
    user = make_user_project(tmp / "user" / "project", tmp / "origin.git", scenes)
    # The state folder lives outside pytest's (mode 0700) tmp folder: as root, PostgreSQL runs as the postgres
    # user, which must reach its data folder.
    state = Path(tempfile.mkdtemp(prefix="splatflow-shared-"))
    os.chmod(state, 0o755)
    t = None
    try:
        with ssh_server(tmp / "sshd") as ssh:
            pport, mport, gport = servers.free_port(), servers.free_port(), servers.free_port()
            serve_log = tmp / "serve.log"
            server_clone = tmp / "server" / "clone"  # the server host deploys from a clone of its own
            run(["git", "clone", "-q", str(tmp / "origin.git"), str(server_clone)], tmp)
            remote = ssh.url(state / "dvc-remote")
            serve = spawn([str(BIN / "splatflow"), "serve", "--shared", "--state-dir", str(state / "srv"),
                           "--prefect-port", str(pport), "--mlflow-port", str(mport), "--pg-port", str(gport),
                           "--dvc-remote", remote, "--start-timeout", "900"],  # a loaded CI host is slow
                          server_clone, env_for(tmp / "server" / "home"), serve_log)
            try:
                wait_for("serve --shared", lambda: "Ctrl-C stops the services" in serve_log.read_text(), 1200,
                         [(serve, serve_log)])
                config = tmp / "server" / "home" / ".config" / "splatflow" / "shared.yaml"
                settings = yaml.safe_load(config.read_text())
                # the user's shell reads the same addresses from its own config file
                user_home = tmp / "user" / "home"
                (user_home / ".config" / "splatflow").mkdir(parents=True)
                shutil.copy(config, user_home / ".config" / "splatflow" / "shared.yaml")
                ssh.authorize(user_home)
                user_env = env_for(user_home)
                run([str(BIN / "dvc"), "remote", "add", "--local", "splatflow-shared",
                     settings["SPLATFLOW_DVC_REMOTE"]], user, env=user_env)
                run([str(BIN / "dvc"), "push", "-r", "splatflow-shared", *[f"raw/{s}.dvc" for s in scenes]], user,
                    env=user_env)
                t = Team(tmp, state, user, user_env, settings, f"http://127.0.0.1:{pport}", ssh, serve)
                yield t
            finally:
                if t is not None:
                    t.stop_workers()
                stop(serve)
    finally:
        shutil.rmtree(state, ignore_errors=True)
