"""Where a pipeline run executes: in the checkout itself, or in a throw-away git worktree.

Two ``dvc repro`` in one workspace at once corrupt each other's outputs (DVC's lock makes the second one fail),
so anything that runs concurrently -- the scenes of a batch on several workers, the configs of a sweep, a rerun of
an old commit -- gets its own **git worktree** (``git worktree add --detach``) under
``<repo>/.dvc/tmp/splatflow/wt/`` with:

* the DVC cache of the main checkout (``.dvc/config.local`` ``cache.dir``), so stages whose inputs are unchanged
  are checked out from the cache instead of recomputed, and results computed there land in the shared cache;
* the raw scene sources (``base.scenes.*.source`` / ``ground_truth``), which are untracked captures, linked from
  the main checkout when the worktree lacks them;
* the git-ignored build outputs the stages need (the report's viewer script, ``splatflow/web/dist/``), copied;
* param overrides applied to the worktree's ``params.yaml`` (``{"train.max_steps": 100}``), never to the user's.

Runs in the checkout itself (``inplace`` flows and ``splatflow run``) hold ``.splatflow/workspace.lock`` so two never
reproduce in one workspace at the same time: the second waits (or stops, when asked not to wait) with a message
naming what holds the workspace; a plain ``dvc repro`` running there is waited for as well.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from splatflow.pipeline.errors import UserError


class WorkspaceError(UserError):
    """The checkout cannot be used as asked (not a commit, git failed, a bad override): the message says why."""


class OverrideError(WorkspaceError, ValueError):
    """A ``--set section.key=value`` that is not one."""


def _git(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise WorkspaceError(f"git {' '.join(args)} failed in {root}: {p.stderr.strip() or p.stdout.strip()}")
    return p


def resolve_commit(root: Path, rev: str) -> str:
    p = _git(root, "rev-parse", "--verify", f"{rev}^{{commit}}", check=False)
    if p.returncode != 0:
        raise WorkspaceError(f"{rev!r} is not a commit of the git repo at {root}; list them with `git log --oneline`")
    return p.stdout.strip()


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.max_steps=100"`` -> ``("train.max_steps", 100)`` (the value is read as YAML, like ``dvc exp -S``)."""
    if "=" not in text:
        raise OverrideError(f"override {text!r} must look like section.key=value (e.g. train.max_steps=100)")
    key, _, value = text.partition("=")
    return key.strip(), yaml.safe_load(value)


def apply_overrides(params_path: Path, overrides: dict[str, Any]) -> None:
    """Set dotted keys in a params.yaml; unknown sections are an error (the strict loader would refuse them)."""
    data = yaml.safe_load(params_path.read_text()) or {}
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if parts[0] not in data:
            raise WorkspaceError(f"override {dotted}: {params_path} has no section {parts[0]!r}")
        node = data
        for p in parts[:-1]:
            if node.get(p) is None:
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise WorkspaceError(f"override {dotted}: {p!r} is not a mapping in {params_path}")
        node[parts[-1]] = value
    params_path.write_text(yaml.safe_dump(data, sort_keys=False))


def _link_sources(main: Path, wt: Path) -> list[str]:
    """Link untracked raw captures named in the worktree's params.yaml from the main checkout."""
    linked = []
    try:
        data = yaml.safe_load((wt / "params.yaml").read_text()) or {}
    except OSError:
        return linked
    for spec in ((data.get("base") or {}).get("scenes") or {}).values():
        for key in ("source", "ground_truth"):
            rel = (spec or {}).get(key)
            if not rel or os.path.isabs(rel):
                continue
            dst, src = wt / rel, main / rel
            if not dst.exists() and src.exists():
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())
                linked.append(rel)
    return linked


#: Git-ignored build outputs a stage needs, copied from the main checkout into a worktree that lacks them: the
#: report's viewer script (``make web``), which the report stage inlines and will not download.
BUILD_OUTPUTS = ("splatflow/web/dist",)


def _copy_build_outputs(main: Path, wt: Path) -> list[str]:
    """Copy :data:`BUILD_OUTPUTS` from the main checkout (copies, not links: a rebuild there must not change a run in
    flight; a bundle built from other web sources than the worktree's commit is still refused by the report)."""
    copied = []
    for rel in BUILD_OUTPUTS:
        src, dst = main / rel, wt / rel
        if src.is_dir() and not dst.exists():
            shutil.copytree(src, dst)
            copied.append(rel)
    return copied


@contextlib.contextmanager
def worktree(main: str | Path, rev: str = "HEAD", *, name: str | None = None, overrides: dict | None = None,
             keep: bool = False) -> Iterator[Path]:
    """A detached git worktree of ``main`` at ``rev``, set up to run the pipeline (see module docstring)."""
    main = Path(main).resolve()
    commit = resolve_commit(main, rev)
    base = main / ".dvc" / "tmp" / "splatflow" / "wt"
    base.mkdir(parents=True, exist_ok=True)
    path = base / (name or f"{commit[:8]}-{uuid.uuid4().hex[:8]}")
    for attempt in range(5):  # concurrent `git worktree add` can collide on git's own lock files
        p = _git(main, "worktree", "add", "--detach", "--force", str(path), commit, check=False)
        if p.returncode == 0:
            break
        if attempt == 4:
            raise WorkspaceError(f"git worktree add failed: {p.stderr.strip()}")
        time.sleep(0.5 + attempt)
    try:
        cache = main / ".dvc" / "cache"
        cfg = path / ".dvc" / "config.local"
        if (path / ".dvc").is_dir():
            cfg.write_text(f"[core]\n    analytics = false\n[cache]\n    dir = {cache}\n")
        _link_sources(main, path)
        _copy_build_outputs(main, path)
        if overrides:
            apply_overrides(path / "params.yaml", overrides)
        yield path
    finally:
        if not keep:
            _git(main, "worktree", "remove", "--force", str(path), check=False)
            if path.exists():
                shutil.rmtree(path, ignore_errors=True)
            _git(main, "worktree", "prune", check=False)


class WorkspaceBusy(WorkspaceError):
    """Another writer (a ``splatflow run``, an in-place flow or a plain ``dvc repro``) works in this checkout."""

    exit_code = 3  # not a bad input: nothing was done, the same command works once the other writer is done


def _lock_path(root: Path) -> Path:
    return Path(root) / ".splatflow" / "workspace.lock"


def _holder(lock: Path) -> dict:
    """What the lock's holder wrote about itself (pid, command, start time), or {} if nothing readable."""
    import json

    try:
        return json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(info: dict) -> str:
    if not info.get("pid"):
        return "another splatflow process"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info['pid']} (`{info.get('command', '?')}`, started {started})"


#: dvc subcommands that write into the workspace (outputs, dvc.lock, the cache); ``exp`` counts with these verbs.
WRITING_COMMANDS = {"repro", "run", "checkout", "pull", "commit", "add", "remove", "move", "update", "import",
                    "import-url", "gc", "destroy", "unprotect"}
WRITING_EXP_COMMANDS = {"run", "apply", "branch", "pull"}


def _dvc_index(cmd: list[str]) -> int | None:
    """Where the dvc program is in a command line: ``dvc``, ``python -m dvc``, ``python .../dvc/__main__.py``."""
    for i, arg in enumerate(cmd[:3]):
        if os.path.basename(arg) == "dvc" and (i == 0 or cmd[i - 1] == "-m" or (
                i == 1 and os.path.basename(cmd[0]).startswith("python"))):  # the venv's script, run by its python
            return i
        if arg.endswith("dvc/__main__.py"):
            return i
    return None


def dvc_subcommand(cmd: list[str]) -> list[str]:
    """The words of a dvc command line after the program and its global options (``dvc -q repro x`` ->
    ``["repro", "x"]``); [] when ``cmd`` is not dvc."""
    i = _dvc_index(cmd)
    if i is None:
        return []
    words, skip = [], False
    for arg in cmd[i + 1:]:
        if skip:
            skip = False
        elif arg == "--cd":
            skip = True
        elif not (arg.startswith("-") and not words):
            words.append(arg)
    return words


def is_writing_dvc(cmd: list[str]) -> bool:
    """A dvc command that writes in its workspace (``repro``, ``exp run``, ``checkout`` ...; not ``status``,
    ``dag``, ``metrics show`` or ``exp show``, which may run beside a writer)."""
    words = dvc_subcommand(cmd)
    if not words:
        return False
    if words[0] == "exp":
        return len(words) > 1 and words[1] in WRITING_EXP_COMMANDS
    return words[0] in WRITING_COMMANDS


def dvc_writers(root: str | Path) -> list[dict]:
    """Writing ``dvc`` processes (other than this process and its ancestors) whose working directory is ``root``: a
    plain ``dvc repro`` started by hand. The worktrees of flows and batches have other directories. Oldest first."""
    import psutil

    root = Path(root).resolve()
    me = psutil.Process()
    mine = {me.pid, *(p.pid for p in me.parents())}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
        try:
            cmd = proc.info["cmdline"] or []
            if proc.pid in mine or not is_writing_dvc(cmd) or Path(proc.cwd()).resolve() != root:
                continue
            found.append({"pid": proc.pid, "command": " ".join(["dvc", *cmd[_dvc_index(cmd) + 1:]])[:200],
                          "started": proc.info["create_time"]})
        except (psutil.Error, OSError):
            continue
    return sorted(found, key=lambda w: w["started"])


def foreign_writer(root: str | Path) -> str | None:
    """Seen from a stage process: who else writes in this checkout, described for a message, or None.

    DVC's own locks do not keep two ``dvc repro`` apart: it releases its workspace lock while a stage's command
    runs and only locks the running stage's deps and outs, so a ``dvc repro`` started by hand beside a running
    ``splatflow run`` (or beside another ``dvc repro``) goes ahead with any stage whose files are not locked --
    another scene's, for one -- and both then rewrite dvc.lock. The stage shell asks this before any work: a
    writer is foreign when it holds splatflow's workspace lock and is not an ancestor of this stage, or when it
    is a writing dvc in this checkout started before the dvc that runs this stage (the older one goes on).
    """
    import psutil

    root = Path(root).resolve()
    me = psutil.Process()
    try:
        ancestors = me.parents()
    except psutil.Error:
        ancestors = []
    mine = {me.pid, *(p.pid for p in ancestors)}
    lock = _lock_path(root)
    if lock.exists():
        with open(lock, "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)  # free: nobody holds it (released at once)
            except BlockingIOError:
                info = _holder(lock)
                if info.get("pid") not in mine:
                    return _describe(info)
            else:
                fcntl.flock(fh, fcntl.LOCK_UN)
    my_dvc_start = None
    for p in ancestors:
        try:
            if is_writing_dvc(p.cmdline()):
                my_dvc_start = p.create_time()
                break
        except psutil.Error:
            continue
    for w in dvc_writers(root):
        if my_dvc_start is None or w["started"] < my_dvc_start:
            return _describe(w)
    return None


def busy_message(root: str | Path, who: str) -> str:
    return (f"{root} is busy: {who} is reproducing in this checkout, and two writers in one DVC workspace corrupt "
            f"each other's outputs. Wait for it to finish (`splatflow run` waits by default), stop it (SIGTERM: its "
            f"stage stops cleanly and reruns next time), or run elsewhere without waiting: "
            f"`splatflow flow <scene> --worktree` works in a throw-away git worktree.")


@contextlib.contextmanager
def workspace_lock(root: str | Path, wait_s: float | None = None,
                   on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Be this checkout's only writer while reproducing in it: hold ``.splatflow/workspace.lock`` (released when
    the process dies, whatever the way), taken once neither another holder nor a plain ``dvc repro`` works here;
    while it waits, it holds nothing, so an older ``dvc repro`` goes on to its next stage undisturbed.

    The holder writes its pid, command and start time into the lock file, so whoever waits can say what holds
    the workspace. ``wait_s``: None waits as long as it takes, a number raises :class:`WorkspaceBusy` after that
    many seconds (0: at once). ``on_wait(message)`` is called once when the wait starts (to tell the user).
    Re-entrant within a thread: ``splatflow run`` holds the lock (with its own waiting and messages) around the
    in-place ``reconstruct`` flow, which takes it again; a flock on a second open file would wait for itself.
    """
    key = (str(Path(root).resolve()), threading.get_ident())
    if _HELD.get(key):
        _HELD[key] += 1
        try:
            yield
        finally:
            _HELD[key] -= 1
        return
    _HELD[key] = 1
    try:
        with _exclusive(root, wait_s, on_wait):
            yield
    finally:
        _HELD.pop(key, None)


#: The checkouts whose workspace lock a thread of this process holds, and how many times (:func:`workspace_lock`).
_HELD: dict[tuple[str, int], int] = {}


@contextlib.contextmanager
def _exclusive(root: str | Path, wait_s: float | None, on_wait: Callable[[str], None] | None) -> Iterator[None]:
    import json
    import sys

    lock = _lock_path(Path(root))
    lock.parent.mkdir(parents=True, exist_ok=True)
    told = False

    def waiting(who: str, t0: float) -> None:
        nonlocal told
        msg = busy_message(root, who)
        if wait_s is not None and time.monotonic() - t0 >= wait_s:
            raise WorkspaceBusy(msg)
        if not told and on_wait is not None:
            on_wait(msg)
        told = True
        time.sleep(1.0)

    with open(lock, "a+") as fh:
        t0 = time.monotonic()
        # A waiter holds nothing: a plain `dvc repro` does not know our lock, but each of its stages checks it
        # (foreign_writer), so holding the lock while waiting for that repro would stop its next stage. The lock is
        # taken only when no such repro runs, and given up again if one started between the look and the lock.
        while True:
            others = dvc_writers(root)
            if others:
                waiting(_describe(others[0]), t0)
                continue
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waiting(_describe(_holder(lock)), t0)
                continue
            others = dvc_writers(root)
            if not others:
                break
            fcntl.flock(fh, fcntl.LOCK_UN)
            waiting(_describe(others[0]), t0)
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(json.dumps({"pid": os.getpid(), "command": " ".join(["splatflow" if "splatflow" in sys.argv[0]
                                                                          else Path(sys.argv[0]).name,
                                                                          *sys.argv[1:]])[:200],
                                 "started": time.time()}) + "\n")
            fh.flush()
            yield
        finally:
            with contextlib.suppress(OSError):
                fh.seek(0)
                fh.truncate()
            fcntl.flock(fh, fcntl.LOCK_UN)


SHELLS = {"sh", "bash", "dash", "zsh", "ksh", "fish"}


def run_foreground(cmd: list[str], cwd: str | Path, env: dict | None = None, *, grace_s: float = 120.0) -> int:
    """Run ``dvc repro`` in the foreground and pass a stop on to the stage below it; return its exit status.

    ``kill <pid>`` (SIGTERM) reaches only this process, and DVC itself dies on SIGTERM without telling the stage
    it runs, which would then go on as an orphan while the workspace lock is already released. So the SIGTERM is
    forwarded to the processes below DVC (the stage records its run KILLED, keeps its checkpoint and exits 143;
    DVC then reports the stage as failed and releases its own locks), or to DVC when no stage runs yet, and this
    process waits for all of them before it returns 143. Ctrl-C reaches the whole foreground process group
    already: DVC ignores SIGINT while a stage runs and the stage stops itself, so here it is only waited for.
    """
    import signal
    import subprocess

    import psutil

    stopped: dict[str, Any] = {"signum": None}
    below: list[psutil.Process] = []

    def forward(signum, frame) -> None:  # noqa: ARG001
        if stopped["signum"] is not None:
            return
        stopped["signum"] = signum
        try:
            procs = psutil.Process().children(recursive=True)
        except psutil.Error:
            procs = []
        below.extend(procs)
        stages = []
        for p in procs:
            try:
                # not DVC, and not the shell DVC runs the stage's cmd in: that one reports the stage's own 143
                if _dvc_index(p.cmdline()) is None and not (p.name() in SHELLS and p.children()):
                    stages.append(p)
            except psutil.Error:
                continue
        for p in stages or [p for p in procs]:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)

    proc = subprocess.Popen(cmd, cwd=str(cwd), env=env)
    old_term = signal.signal(signal.SIGTERM, forward)
    old_int = signal.signal(signal.SIGINT, lambda *_: stopped.__setitem__("signum", stopped["signum"] or
                                                                          signal.SIGINT))
    try:
        rc = proc.wait()
        if below:  # a stage that outlived DVC is still recording its stop: the workspace is not free before
            psutil.wait_procs(below, timeout=grace_s)
    finally:
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
    if stopped["signum"] is not None and rc != 0:  # (a stop that came after DVC had finished changed nothing)
        return 128 + int(stopped["signum"])
    return rc
