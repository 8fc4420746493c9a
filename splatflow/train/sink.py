"""Where a training run's numbers go: the per-step CSV (``plots/S/train.csv``), the log, the tracking step
logger (MLflow step metrics, optional) and the watchers (the live view). The loop hands rows and refine events
over; it never formats them.

A watcher is any object with ``after_step(trainer, row)``: the loop calls :meth:`MetricsSink.step` once per
finished step, after the row was logged and before checkpoints or stops, outside the run's random generators. A
watcher reads the trainer (``trainer.step``, ``trainer.state.params``, ``trainer.cfg``, ``trainer.sched``) and changes
nothing, so a watched run ends with the parameters of the same run unwatched. ``row`` is the step's record
(``step``, ``gaussians``, ``loss``; ``psnr`` only on the rows the loop logs). A watcher that raises is dropped with
one warning: watching a run never stops it."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

log = logging.getLogger("splatflow.train")

CSV_FIELDS = ("step", "phase", "resolution", "sigma", "loss", "l1", "ssim", "psnr", "gaussians", "seconds")
STEP_METRICS = ("loss", "l1", "ssim", "psnr", "gaussians", "sigma")  # of a row, sent to the step logger
REFINE_COUNTS = ("clones", "splits", "prunes", "relocated", "added")  # of a refine event


class MetricsSink:
    """The CSV at ``csv_path`` (None: no file), the ``step_logger`` (``log(step, {name: value})`` and
    ``close()``; None: none) and the ``watchers`` (module docstring). Rows are written as they come, so the CSV can
    be watched while training runs."""

    def __init__(self, csv_path: str | Path | None = None, step_logger=None, watchers=()):
        self.csv_path = Path(csv_path) if csv_path else None
        self.step_logger = step_logger
        self.watchers = list(watchers)
        self._rows: list[dict] = []

    def start(self, step: int) -> None:
        """Start the CSV afresh (``step`` 0), or keep only its rows up to ``step`` (a resumed run)."""
        if not self.csv_path or not self.csv_path.exists():
            return
        keep = []
        if step > 0:
            with open(self.csv_path, newline="") as f:
                keep = [r for r in csv.DictReader(f) if int(r["step"]) <= step]
        self.csv_path.unlink()
        self._rows = keep
        self.flush()

    def row(self, row: dict) -> None:
        """One logged step (the keys of :data:`CSV_FIELDS`): to the CSV now and to the step logger."""
        self._rows.append(row)
        self.flush()
        if self.step_logger is not None:
            self.step_logger.log(row["step"], {k: float(row[k]) for k in STEP_METRICS})

    def step(self, trainer, row: dict) -> None:
        """Every finished step, to each watcher; a failing one is dropped with a warning (training goes on)."""
        for w in list(self.watchers):
            try:
                w.after_step(trainer, row)
            except Exception as e:  # noqa: BLE001 - a viewer's failure must not end a training run
                self.watchers.remove(w)
                log.warning(f"{type(w).__name__} failed at step {trainer.step} and is switched off: "
                            f"{type(e).__name__}: {e}")

    def event(self, ev: dict) -> None:
        """A refine event of the densification strategy: logged, and its counts sent as step metrics."""
        parts = [f"{k} {ev[k]}" for k in REFINE_COUNTS if k in ev]
        log.info(f"step {ev['step']}: refine: {', '.join(parts)} -> {ev['gaussians']} Gaussians"
                 + (" (opacity reset)" if ev.get("opacity_reset") else ""))
        if self.step_logger is not None:
            self.step_logger.log(ev["step"], {f"refine_{k}": float(ev[k]) for k in (*REFINE_COUNTS, "gaussians")
                                              if k in ev})

    def flush(self) -> None:
        if not self.csv_path:
            return
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.csv_path.exists() or self.csv_path.stat().st_size == 0
        with open(self.csv_path, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            if new:
                w.writeheader()
            w.writerows(self._rows)
        self._rows = []

    def close(self) -> None:
        """Flush the CSV and close the step logger (whose failure never breaks training)."""
        self.flush()
        if self.step_logger is not None:
            try:
                self.step_logger.close()
            except Exception:  # noqa: BLE001 - tracking must never break training
                pass
