"""Run DVC stages from orchestration code: the stage order from DVC's own graph, one stage per process group.

DVC owns the DAG (docs/design.md §2): the flows never list stages themselves, they ask DVC.  Each stage runs as
``dvc repro --single-item <stage>@<scene>`` in a new session (its own process group), so that a cancel or a
timeout can stop the whole stage -- ``dvc``, the shell it spawns and the python stage below it -- and not just
the direct child.  DVC itself leaves the workspace consistent after such a kill: the stage's dvc.lock entry is
only written after the stage succeeds, so the stage simply reruns next time.
"""

from __future__ import annotations

import collections
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from splatflow.pipeline.errors import UserError
from splatflow.pipeline.scene_settings import missing_source

VENV_BIN = Path(sys.executable).parent
#: DVC's message when another dvc process holds the workspace lock: the one failure a retry can fix.
LOCK_BUSY = re.compile(r"Unable to acquire lock|is busy|LockError", re.IGNORECASE)
KILL_GRACE_S = 10.0


#: The stage's own exit status in DVC's ``failed to run: python -m stages.x S, exited with N`` (DVC itself exits 255).
_STAGE_STATUS = re.compile(r"exited with (-?\d+)")
#: The one-paragraph message of a stage that stopped on a bad input (``splatflow.pipeline.stage.stage_main``).
_STAGE_MESSAGE = re.compile(r"^splatflow \S+ \[[^\]]*\] failed: .*$", re.MULTILINE)


def stage_status(returncode: int, tail: str) -> int:
    """The stage process's exit status: DVC exits 255 for any failed stage and names the stage's own in its text."""
    found = _STAGE_STATUS.findall(tail)
    return int(found[-1]) if found else returncode


def failure_reason(text: str) -> str:
    """One line saying why a scene's run failed, from a :class:`StageFailed` message or a flow run state's message:
    the stage's own ``splatflow <stage> [<scene>] failed: ...`` line when there is one, else the first line."""
    found = _STAGE_MESSAGE.findall(text or "")
    if found:
        return found[-1].strip()
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[0] if lines else "no message"


class StageFailed(RuntimeError):
    """A DVC stage exited non-zero: deterministic (bad input, bug) -- retrying would fail the same way."""

    def __init__(self, stage: str, returncode: int, tail: str):
        self.stage, self.returncode, self.tail = stage, returncode, tail
        status = stage_status(returncode, tail)  # 2, 143, 1: the stage's; DVC's own is 255 whatever happened
        hint = " (bad input or setting: see the message above)" if status == 2 else ""
        if status == 143:
            hint = " (stopped by SIGTERM: partial work kept where the stage has any; rerun to continue)"
        code = f"exit code {status}" if status == returncode else f"exit code {status} (dvc: {returncode})"
        super().__init__(f"stage {stage} failed with {code}{hint}:\n{tail}")


class WorkspaceBusy(StageFailed):
    """Another ``dvc`` process holds this workspace's lock: transient, worth a retry after a pause."""


class StageTimeout(StageFailed):
    """The stage ran longer than its timeout and was killed (with its whole process group)."""


class StageCancelled(StageFailed):
    """The stage was stopped because its caller was cancelled or terminated."""


def dvc_executable() -> str:
    """The project venv's ``dvc`` (``cmd: python`` in dvc.yaml then resolves to the venv's python too)."""
    exe = VENV_BIN / "dvc"
    return str(exe) if exe.exists() else "dvc"


def stage_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for DVC subprocesses: venv bin first on PATH (docs/design.md §3), quiet telemetry, unbuffered."""
    env = os.environ.copy()
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def stage_order(root: str | Path, scene: str | None = None) -> list[str]:
    """Stage addresses (``ingest@demo``, ...) in an order that respects DVC's graph.

    Ties are broken by the order of dvc.yaml, so the list reads like the pipeline.  With ``scene`` only that
    scene's stages (``<name>@<scene>``) are kept.
    """
    import networkx as nx
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    with Repo(str(root)) as repo:
        stages = list(repo.index.stages)
        graph = repo.index.graph  # edges: dependent -> dependency
        pos = {s: i for i, s in enumerate(stages)}
        order = list(nx.lexicographical_topological_sort(graph.reverse(copy=True), key=lambda s: pos.get(s, 1 << 30)))
        # not .addressing: that is relative to the cwd; a .dvc file's stage (a `dvc add`-ed capture) has no name
        # and runs nothing: it is left out
        names = [s.name for s in order if isinstance(s, PipelineStage)]
    if scene is not None:
        names = [n for n in names if n.partition("@")[2] == scene]
    return names


def check_sources(root: str | Path, scenes: list[str]) -> None:
    """Refuse, before DVC starts, to run scenes whose capture is not there: a ``base.scenes.<scene>.source`` (the
    ingest stage's DVC dependency) that does not exist. DVC would stop at that dependency with a bare errno -- and
    only after removing the ingest stage's earlier outputs, the git-tracked ``metrics/<scene>/ingest.json``
    included (an unmounted drive cost a finished scene its ingest). Raises a UserError that names each missing
    path and the fix; nothing has run then."""
    import yaml

    root = Path(root)
    try:  # read as DVC reads it (the params are validated by the stages; a flow may drive another DVC project)
        entries = (yaml.safe_load((root / "params.yaml").read_text()) or {}).get("base", {}).get("scenes", {})
    except (OSError, yaml.YAMLError, AttributeError):
        return
    problems = []
    for scene in scenes:
        src = (entries.get(scene) or {}).get("source") if isinstance(entries, dict) else None
        if not isinstance(src, str) or not src:
            continue
        problem = missing_source(root, scene, src)
        if problem:
            problems.append(problem)
    if problems:
        raise UserError("\n".join(problems) + "\nNothing was run, and the scene's earlier outputs are untouched"
                        + (" (name the scenes to run: `splatflow run SCENE`)" if len(scenes) > 1 else "") + ".")


def scenes_in_graph(root: str | Path) -> list[str]:
    """Scene names that have stages in dvc.yaml (the ``foreach`` keys)."""
    seen: list[str] = []
    for n in stage_order(root):
        item = n.partition("@")[2]
        if item and item not in seen:
            seen.append(item)
    return seen


@dataclass
class StageResult:
    stage: str
    returncode: int
    seconds: float
    skipped: bool  # DVC found the stage up to date and did not run it
    tail: str = ""
    lines: list[str] = field(default_factory=list)


def kill_group(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM the process group (stages mark their MLflow run KILLED), then SIGKILL what is left."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    # The group may outlive its leader: dvc can exit at once while the stage python below it is still in its
    # SIGTERM handler marking the MLflow run KILLED.  Give the members the rest of the grace period.
    while time.monotonic() < deadline and _group_members(proc.pid):
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _group_members(pgid: int) -> list[int]:
    import psutil

    members = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.info["pid"]) == pgid:
                members.append(p.info["pid"])
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return members


def run_dvc_stage(root: str | Path, stage: str, *, force: bool = False, timeout_s: float | None = None,
                  env: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None,
                  cancel_event: threading.Event | None = None, echo: TextIO | None = None) -> StageResult:
    """``dvc repro --single-item <stage>`` in its own process group; raise a :class:`StageFailed` subclass on
    failure (:class:`WorkspaceBusy` when another dvc holds the lock, :class:`StageTimeout` on timeout).

    Any exception raised while waiting (Prefect's termination signal, KeyboardInterrupt) kills the whole group
    before it propagates, so no stage outlives its task. ``echo`` (a terminal, for ``splatflow run``) gets the
    command and the stage's output as it comes, carriage returns included, so a progress bar redraws in place
    there while ``on_line`` sees one line per frame.
    """
    cmd = [dvc_executable(), "repro", "--single-item", stage]
    if force:
        cmd.append("--force")
    if echo is not None:
        echo.write("$ " + " ".join(["dvc", *cmd[1:]]) + "\n")
        echo.flush()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=str(root), env=env or stage_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=60)
    lines: list[str] = []

    def pump():
        assert proc.stdout is not None
        # newline="": lines end at \n, \r or \r\n and keep their ending, which the echo needs to redraw in place
        for raw in io.TextIOWrapper(proc.stdout, encoding="utf-8", errors="replace", newline=""):
            if echo is not None:
                try:
                    echo.write(raw)
                    echo.flush()
                except (OSError, ValueError):  # a closed terminal must not hang the pump
                    pass
            line = raw.rstrip("\r\n")
            tail.append(line)
            lines.append(line)
            if on_line is not None:
                try:
                    on_line(line)
                except Exception:  # noqa: BLE001 - a logging hiccup must not hang the pump
                    pass

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = cancelled = False
    try:
        while proc.poll() is None:
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                timed_out = True
                kill_group(proc)
                break
            if cancel_event is not None and cancel_event.is_set():
                cancelled = True
                kill_group(proc)
                break
            time.sleep(0.2)
    except BaseException:
        kill_group(proc)
        raise
    reader.join(timeout=5)
    rc = proc.wait()
    seconds = time.monotonic() - t0
    text = "\n".join(tail)
    if timed_out:
        raise StageTimeout(stage, rc, f"killed after {timeout_s:.0f} s timeout\n{text}")
    if cancelled:
        raise StageCancelled(stage, rc, f"cancelled\n{text}")
    if rc != 0:
        if LOCK_BUSY.search(text):
            raise WorkspaceBusy(stage, rc, text)
        raise StageFailed(stage, rc, text)
    skipped = any("didn't change, skipping" in ln or "is cached - skipping" in ln for ln in lines)
    return StageResult(stage, rc, seconds, skipped, text, lines)


def status(root: str | Path, stages: list[str], env: dict[str, str] | None = None) -> dict:
    """``dvc status --json <stages>``: what DVC finds changed for each stage ({} when all are up to date)."""
    import json

    p = subprocess.run([dvc_executable(), "status", "--json", *stages], cwd=str(root), env=env or stage_env(),
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise StageFailed("status", p.returncode, (p.stdout + p.stderr)[-4000:])
    text = p.stdout.strip()
    return json.loads(text[text.index("{"):]) if "{" in text else {}


#: How ``dvc status`` lists a stage marked ``always_changed`` (the settings stage).
ALWAYS_CHANGED = "always changed"


def _inside_any(path: str, outs: set[str]) -> bool:
    """``path`` is one of ``outs`` or lies inside one (a stage may depend on part of an upstream output folder:
    split reads ``data/S/undistorted/sparse`` of sfm's ``data/S/undistorted``)."""
    return any(path == o or path.startswith(o.rstrip("/") + "/") for o in outs)


def only_outputs_missing(root: str | Path, stages: list[str], env: dict[str, str] | None = None) -> tuple[bool, str]:
    """Whether the stages recorded in ``root``'s dvc.lock would give the same results now, in a workspace that
    merely lacks their outputs (a fresh worktree with an earlier run's dvc.lock put in place).

    DVC compares each stage's command, deps (code, data, the upstream outputs recorded in the lock) and params with
    the lock; here every change it reports must be an output of a locked stage that is absent ("deleted"), never
    a modified dep, a changed param or command, or a stage the lock does not have.  Returns (verdict, reason).
    """
    import yaml

    lock = yaml.safe_load((Path(root) / "dvc.lock").read_text()) or {}
    locked = lock.get("stages") or {}
    outs = {o["path"] for st in locked.values() for o in (st.get("outs") or []) if isinstance(o, dict) and "path" in o}
    missing = [s for s in stages if s not in locked]
    if missing:
        return False, f"dvc.lock has no entry for {', '.join(missing)}"
    for stage, changes in status(root, stages, env).items():
        for change in changes:
            if change == ALWAYS_CHANGED:  # the settings stage: it runs in every repro and changes nothing
                continue
            if not isinstance(change, dict):
                return False, f"{stage}: {change}"
            for kind, files in change.items():
                for path, what in (files or {}).items():
                    if what != "deleted" or not _inside_any(path, outs):
                        return False, f"{stage}: {kind} {path} {what}"
    return True, "every stage up to date with the earlier run's dvc.lock (only its outputs are absent here)"
