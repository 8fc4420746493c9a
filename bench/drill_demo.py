"""Stop drills on the demo scene: does a run stopped during training, then rerun, end where an unstopped run ends?

In a fresh clone of this repository (so nothing of the checkout's own outputs, caches or MLflow store is used):

1. ``splatflow demo-scene``, then an uninterrupted ``splatflow run demo``;
2. ``splatflow run demo`` stopped with SIGTERM (to the ``splatflow`` process alone, as ``kill <pid>`` does) during
   training, then ``splatflow run demo`` again;
3. ``splatflow run demo`` killed with SIGKILL during training after its first periodic checkpoint (every process of
   the run at once: the CLI, DVC and the stage, as a crash would), ``splatflow runs reap``, then
   ``splatflow run demo`` again.

Before 2 and 3 the train stage's checkpoint is deleted, so DVC retrains from scratch (``persist`` keeps DVC's
run cache out of that stage) while the earlier stages (ingest, SfM, split) stay as they are: the drills compare
training, not SfM's run-to-run jitter. Prints the three test PSNRs, their difference from the uninterrupted run
against the run-to-run spread measured by ``bench/variance.py`` (``bench/variance.json``), whether the trained
Gaussians are identical, whether the run resumed after the kill repeats the killed run's logged training loss bit for
bit over the steps both ran (an exact resume), and the MLflow statuses of every run read back from the clone's MLflow store
(expected: 1 FINISHED; 2 KILLED, FINISHED; 3 RUNNING until reaped, then KILLED, FINISHED).

Not a CI test: it trains the demo three times (about 20-40 minutes on 2 busy cores).

    python bench/drill_demo.py [--json out.json] [--work /tmp/drill] [--keep] [--web-dist DIR]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENE = "demo"


def log(msg: str) -> None:
    print(f"[drill {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


class Clone:
    def __init__(self, path: Path, source: Path):
        self.path, self.source = path, source
        self.logs = path.parent / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        bin_dir = Path(sys.executable).parent
        self.env = os.environ.copy()
        self.env.update({"PYTHONPATH": str(path), "PATH": f"{bin_dir}{os.pathsep}{self.env.get('PATH', '')}",
                         "OMP_WAIT_POLICY": "PASSIVE", "SPLATFLOW_TRACKING": "on", "PYTHONUNBUFFERED": "1",
                         "MLFLOW_DISABLE_TELEMETRY": "true", "DVC_NO_ANALYTICS": "1"})
        for k in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "SPLATFLOW_STAGE_HOLD_S"):
            self.env.pop(k, None)  # the clone's own store: sqlite:///<clone>/mlflow.db
        self.n = 0

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "splatflow.cli", *args]

    def run(self, *args: str, ok=(0,)) -> tuple[int, Path]:
        self.n += 1
        out = self.logs / f"{self.n:02d}-{'-'.join(args)[:40]}.log"
        t0 = time.monotonic()
        log(f"$ splatflow {' '.join(args)}   (log {out}; load {load_avg()})")
        with out.open("w") as f:
            rc = subprocess.call(self.cli(*args), cwd=self.path, env=self.env, stdout=f, stderr=subprocess.STDOUT)
        log(f"  exit {rc} after {time.monotonic() - t0:.0f} s")
        if ok is not None and rc not in ok:
            raise SystemExit(f"drill: `splatflow {' '.join(args)}` exited {rc}; see {out}:\n{out.read_text()[-3000:]}")
        return rc, out

    def start(self, *args: str) -> tuple[subprocess.Popen, Path]:
        self.n += 1
        out = self.logs / f"{self.n:02d}-{'-'.join(args)[:40]}.log"
        log(f"$ splatflow {' '.join(args)} &   (log {out}; load {load_avg()})")
        f = out.open("w")
        # its own session, so that the SIGKILL drill can take the whole run at once, like a crash would
        proc = subprocess.Popen(self.cli(*args), cwd=self.path, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        f.close()
        return proc, out

    # what the run left behind
    def train_step(self, since: float) -> int:
        """The last step in plots/demo/train.csv written after ``since`` (the trainer flushes it while it runs)."""
        csv_path = self.path / "plots" / SCENE / "train.csv"
        try:
            if csv_path.stat().st_mtime < since:
                return -1
            with csv_path.open(newline="") as f:
                rows = list(csv.DictReader(f))
            return int(float(rows[-1]["step"])) if rows else -1
        except (OSError, ValueError, KeyError, IndexError):
            return -1

    @property
    def ckpt(self) -> Path:
        return self.path / "models" / SCENE / "train" / "ckpt.pt"

    def result(self) -> dict:
        m = self.path / "metrics" / SCENE
        ev = json.loads((m / "evaluate.json").read_text())
        tr = json.loads((m / "train.json").read_text())
        return {"psnr_test": ev["psnr"], "ssim_test": ev["ssim"], "gaussians": ev["gaussians"],
                "train_steps": tr.get("steps"), "train_gaussians": tr.get("gaussians"),
                "train_val_psnr": tr.get("val_psnr"), "train_resumed_from": tr.get("resumed_from"),
                "train_seconds": tr.get("train_seconds"), "train_splats_md5": splats_digest(self.ckpt)}

    def loss_history(self, run_id: str) -> dict[int, float]:
        from mlflow.tracking import MlflowClient

        cl = MlflowClient(tracking_uri=f"sqlite:///{self.path / 'mlflow.db'}")
        return {m.step: m.value for m in cl.get_metric_history(run_id, "train/loss")}

    def mlflow_runs(self) -> list[dict]:
        from mlflow.tracking import MlflowClient

        cl = MlflowClient(tracking_uri=f"sqlite:///{self.path / 'mlflow.db'}")
        exps = [e.experiment_id for e in cl.search_experiments()]
        runs = cl.search_runs(exps, filter_string=f"tags.`splatflow.scene` = '{SCENE}'", max_results=1000,
                              order_by=["attributes.start_time ASC"]) if exps else []
        return [{"run_id": r.info.run_id, "name": r.info.run_name, "status": r.info.status,
                 "start": r.info.start_time / 1000.0,
                 "stages": {k.rpartition(".")[2]: v for k, v in r.data.tags.items()
                            if k.startswith("splatflow.stage.")}} for r in runs]

    def runs_since(self, t: float) -> list[dict]:
        return [r for r in self.mlflow_runs() if r["start"] >= t - 1]


def splats_digest(ckpt: Path) -> str | None:
    """md5 of the trained Gaussians' tensors (the file's own md5 also covers its wall-clock fields)."""
    import torch

    if not ckpt.exists():
        return None
    splats = torch.load(ckpt, map_location="cpu", weights_only=False)["splats"]
    h = hashlib.md5()
    for k in sorted(splats):
        h.update(k.encode() + b"\0" + splats[k].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def resume_check(clone: Clone, stopped: dict, resumed: dict) -> dict:
    """Compare the logged training loss of the stopped run and the run that resumed it over the steps both logged
    (those between the checkpoint it resumed from and the stop): an exact resume repeats them bit for bit."""
    a, b = clone.loss_history(stopped["run_id"]), clone.loss_history(resumed["run_id"])
    common = sorted(set(a) & set(b))
    differ = [st for st in common if a[st] != b[st]]
    return {"overlap_steps": [common[0], common[-1]] if common else None, "logged_steps_compared": len(common),
            "first_differing_step": differ[0] if differ else None, "exact": bool(common) and not differ}


def wait_for_step(clone: Clone, proc: subprocess.Popen, step: int, since: float, out: Path) -> int:
    last = -1
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"drill: the run ended (exit {proc.returncode}) before training reached step {step}; "
                             f"see {out}")
        s = clone.train_step(since)
        if s != last and s >= 0 and s // 200 != last // 200:
            log(f"  training at step {s}")
        last = s
        if s >= step:
            return s
        time.sleep(0.5)


def procs_in(folder: Path) -> list[int]:
    """Processes (other than this one) working in ``folder``: what a stop left running there."""
    import psutil

    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and Path(p.cwd()).resolve() == folder.resolve():
                found.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return found


def tree(pid: int) -> list[int]:
    import psutil

    try:
        p = psutil.Process(pid)
        return [pid, *(c.pid for c in p.children(recursive=True))]
    except psutil.Error:
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=ROOT, help="git repository to clone (its HEAD; default: this one)")
    ap.add_argument("--work", type=Path, default=None, help="folder for the clone and logs (default: a new /tmp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the clone afterwards")
    ap.add_argument("--web-dist", type=Path, default=None,
                    help="a built splatflow/web/dist to copy into the clone (the report stage's viewer script); "
                         "default: the source's own if it has one, else `splatflow build-web` (npm) in the clone")
    ap.add_argument("--term-step", type=int, default=600, help="training step after which SIGTERM is sent")
    ap.add_argument("--kill-step", type=int, default=None,
                    help="training step after which SIGKILL is sent (default: 30 %% of the checkpoint interval past "
                         "the first periodic checkpoint)")
    ap.add_argument("--only", choices=("sigterm", "sigkill"), action="append", default=None,
                    help="run only this stop drill (repeatable; default: both)")
    ap.add_argument("--from-clone", type=Path, default=None,
                    help="skip the uninterrupted run: take the demo's data, DVC cache and dvc.lock and the "
                         "uninterrupted run's metrics from this earlier drill clone (to run the drills side by side "
                         "in two clones on a busy machine)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    drills = args.only or ["sigterm", "sigkill"]

    work = Path(args.work or tempfile.mkdtemp(prefix="splatflow-drill-", dir="/tmp")).resolve()
    clone_dir = work / "repo"
    if clone_dir.exists():
        raise SystemExit(f"drill: {clone_dir} exists; give an empty --work folder")
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=args.source, capture_output=True, text=True,
                          check=True).stdout.strip()
    log(f"cloning {args.source} @ {head[:10]} into {clone_dir}; load {load_avg()}, {os.cpu_count()} cores")
    subprocess.run(["git", "clone", "-q", str(args.source), str(clone_dir)], check=True)
    clone = Clone(clone_dir, args.source)
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "config", "--local", "core.analytics", "false"],
                   cwd=clone_dir, check=True, env=clone.env)

    dist = args.web_dist or (args.source / "splatflow" / "web" / "dist")
    if dist.is_dir():
        shutil.copytree(dist, clone_dir / "splatflow" / "web" / "dist")
    else:
        clone.run("build-web")

    sys.path.insert(0, str(clone_dir))
    from splatflow.pipeline.config import load_params
    from splatflow.train.plan import checkpoint_every

    params = load_params(clone_dir / "params.yaml").for_scene(SCENE)
    every, max_steps = checkpoint_every(params.train, "cpu"), params.train.max_steps
    kill_step = args.kill_step or every + int(0.3 * every)
    if not (args.term_step < max_steps and every < kill_step < max_steps):
        raise SystemExit(f"drill: need term step {args.term_step} and kill step {kill_step} inside the "
                         f"{max_steps} training steps, the kill after the first checkpoint (every {every})")
    variance = json.loads((clone_dir / "bench" / "variance.json").read_text())
    spread = float(variance["psnr_spread_db"])

    report: dict = {"commit": head, "clone": str(clone_dir), "cores": os.cpu_count(), "load_start": load_avg(),
                    "max_steps": max_steps, "checkpoint_every": every, "term_step": args.term_step,
                    "kill_step": kill_step, "variance_psnr_spread_db": spread, "scenarios": {}}

    if args.from_clone is not None:
        # the earlier clone's inputs of training (scene, SfM, split), its DVC cache and lock, and the uninterrupted
        # run's metrics; not its MLflow store (statuses are read for this clone's runs only) nor DVC's tmp locks
        src = args.from_clone.resolve()
        for rel in ("data", "metrics", "plots", "models", ".dvc/cache", "dvc.lock"):
            if (src / rel).is_dir():
                shutil.copytree(src / rel, clone_dir / rel, symlinks=True, dirs_exist_ok=True)
            elif (src / rel).exists():
                shutil.copy2(src / rel, clone_dir / rel)
        import yaml

        lock = yaml.safe_load((clone_dir / "dvc.lock").read_text())
        md5 = next(o["md5"] for o in lock["stages"][f"train@{SCENE}"]["outs"] if o["path"].endswith("ckpt.pt"))
        m = clone_dir / "metrics" / SCENE
        ev, tr = (json.loads((m / f"{n}.json").read_text()) for n in ("evaluate", "train"))
        a = {"psnr_test": ev["psnr"], "ssim_test": ev["ssim"], "gaussians": ev["gaussians"],
             "train_steps": tr.get("steps"), "train_gaussians": tr.get("gaussians"),
             "train_val_psnr": tr.get("val_psnr"), "train_resumed_from": tr.get("resumed_from"),
             "train_seconds": tr.get("train_seconds"), "train_ckpt_md5": md5, "mlflow": ["FINISHED"],
             "train_splats_md5": splats_digest(clone.ckpt), "from_clone": str(src)}
        report["scenarios"]["uninterrupted"] = a
        log(f"uninterrupted (from {src}): test PSNR {a['psnr_test']:.4f} dB, checkpoint md5 {md5}")
    else:
        clone.run("demo-scene")
        # 1. uninterrupted
        t1 = time.time()
        clone.run("run", SCENE)
        a = clone.result()
        a["mlflow"] = [r["status"] for r in clone.runs_since(t1)]
        a["wall_seconds"] = round(time.time() - t1)
        report["scenarios"]["uninterrupted"] = a
        log(f"uninterrupted: test PSNR {a['psnr_test']:.4f} dB, {a['gaussians']} Gaussians; MLflow {a['mlflow']}")
    if "sigterm" in drills:
        sigterm_drill(clone, args, report)
    if "sigkill" in drills:
        sigkill_drill(clone, kill_step, report)
    return verdict(report, args, clone, t_start)


def sigterm_drill(clone: Clone, args, report: dict) -> None:
    """2. SIGTERM to the splatflow process during training, then rerun."""
    clone_dir = clone.path
    clone.ckpt.unlink(missing_ok=True)
    t2 = time.time()
    proc, out = clone.start("run", SCENE)
    at = wait_for_step(clone, proc, args.term_step, t2, out)
    log(f"  SIGTERM to splatflow (pid {proc.pid}) at training step {at}")
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=600)
    leftovers = procs_in(clone_dir)
    ckpt_after_stop = clone.ckpt.exists()
    statuses_stopped = [r["status"] for r in clone.runs_since(t2)]
    log(f"  exit {rc}; checkpoint kept: {ckpt_after_stop}; MLflow {statuses_stopped}")
    t2b = time.time()
    clone.run("run", SCENE)
    b = clone.result()
    b.update({"signal_at_step": at, "stopped_exit": rc, "stopped_checkpoint_kept": ckpt_after_stop,
              "stopped_leftover_pids": leftovers, "mlflow_after_stop": statuses_stopped,
              "mlflow": [r["status"] for r in clone.runs_since(t2)],
              "mlflow_rerun": [r["status"] for r in clone.runs_since(t2b)],
              "wall_seconds": round(time.time() - t2)})
    report["scenarios"]["sigterm"] = b
    log(f"sigterm: test PSNR {b['psnr_test']:.4f} dB (resumed from step {b['train_resumed_from']}); "
        f"MLflow {b['mlflow']}")


def sigkill_drill(clone: Clone, kill_step: int, report: dict) -> None:
    """3. SIGKILL to every process of the run during training, reap, rerun."""
    clone.ckpt.unlink(missing_ok=True)
    t3 = time.time()
    proc, out = clone.start("run", SCENE)
    at = wait_for_step(clone, proc, kill_step, t3, out)
    pids = tree(proc.pid)
    log(f"  SIGKILL to the run's processes {pids} at training step {at}")
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)
    statuses_killed = [r["status"] for r in clone.runs_since(t3)]
    _, reap_log = clone.run("runs", "reap")
    statuses_reaped = [r["status"] for r in clone.runs_since(t3)]
    log(f"  MLflow before reap {statuses_killed}, after {statuses_reaped}: {reap_log.read_text().strip()[-300:]}")
    t3b = time.time()
    _, rerun_log = clone.run("run", SCENE)
    c = clone.result()
    runs3 = clone.runs_since(t3)
    if len(runs3) == 2:
        c["resume_check"] = resume_check(clone, runs3[0], runs3[1])
    c.update({"signal_at_step": at, "mlflow_after_kill": statuses_killed, "mlflow_after_reap": statuses_reaped,
              "mlflow": [r["status"] for r in clone.runs_since(t3)],
              "mlflow_rerun": [r["status"] for r in clone.runs_since(t3b)],
              "dvc_lock_messages": [ln for ln in rerun_log.read_text().splitlines() if "lock" in ln.lower()][:5],
              "wall_seconds": round(time.time() - t3)})
    report["scenarios"]["sigkill"] = c
    log(f"sigkill: test PSNR {c['psnr_test']:.4f} dB (resumed from step {c['train_resumed_from']}); "
        f"MLflow {c['mlflow']}")


def verdict(report: dict, args, clone: Clone, t_start: float) -> int:
    head, clone_dir = report["commit"], clone.path
    spread = report["variance_psnr_spread_db"]
    a = report["scenarios"]["uninterrupted"]
    ok = True
    print(f"\nDemo stop drills, commit {head[:10]} ({os.cpu_count()} cores, load at start {report['load_start']}, "
          f"now {load_avg()}; {(time.time() - t_start) / 60:.1f} min in all)")
    print(f"run-to-run spread of test PSNR (bench/variance.json, 3 seeds): {spread:.4f} dB")
    print(f"{'run':15s} {'test PSNR':>10s} {'diff':>9s} {'within':>7s} {'Gaussians':>9s} {'resumed':>8s} "
          f"{'same splats':>10s}  MLflow statuses (oldest first)")
    for name, r in report["scenarios"].items():
        diff = r["psnr_test"] - a["psnr_test"]
        r["psnr_diff_db"] = round(diff, 6)
        r["within_spread"] = abs(diff) <= spread
        r["same_splats"] = (r["train_splats_md5"] == a["train_splats_md5"]) if a["train_splats_md5"] else None
        print(f"{name:15s} {r['psnr_test']:10.4f} {diff:+9.4f} {str(r['within_spread']):>7s} {r['gaussians']:9d} "
              f"{str(r['train_resumed_from']):>8s} {str(r['same_splats']):>10s}  {r['mlflow']}")
        if r.get("resume_check"):
            print(f"{'':15s} resumed run vs the killed run over logged steps {r['resume_check']['overlap_steps']}: "
                  f"{'bit-identical loss' if r['resume_check']['exact'] else r['resume_check']}")
        ok &= r["within_spread"]
    expect = {"uninterrupted": ["FINISHED"], "sigterm": ["KILLED", "FINISHED"], "sigkill": ["KILLED", "FINISHED"]}
    for name, want in expect.items():
        if name not in report["scenarios"]:
            continue
        got = report["scenarios"][name]["mlflow"]
        if got != want:
            print(f"  {name}: MLflow statuses {got}, expected {want}")
            ok = False
    term, kill = report["scenarios"].get("sigterm"), report["scenarios"].get("sigkill")
    if term and term["stopped_exit"] != 143:
        print(f"  sigterm: `splatflow run` exited {term['stopped_exit']}, expected 143")
        ok = False
    if term and term["stopped_leftover_pids"]:
        print(f"  sigterm: processes left working in the clone after the stop: {term['stopped_leftover_pids']}")
        ok = False
    if kill and kill["mlflow_after_kill"] != ["RUNNING"]:
        print(f"  sigkill: before reap the run was {kill['mlflow_after_kill']}")
    report["ok"] = ok
    report["minutes"] = round((time.time() - t_start) / 60, 1)
    report["load_end"] = load_avg()
    print("=> " + ("every stop ended where the uninterrupted run ended, statuses as expected" if ok else "FAILED"))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    if not args.keep:
        shutil.rmtree(clone_dir, ignore_errors=True)
    else:
        print(f"clone kept: {clone_dir}; logs: {clone.logs}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
