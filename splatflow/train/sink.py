"""Where a training run's numbers go: the per-step CSV (``plots/S/train.csv``), the log, and the tracking step
logger (MLflow step metrics, optional). The loop hands rows and refine events over; it never formats them."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

log = logging.getLogger("splatflow.train")

CSV_FIELDS = ("step", "phase", "resolution", "sigma", "loss", "l1", "ssim", "psnr", "gaussians", "seconds")
STEP_METRICS = ("loss", "l1", "ssim", "psnr", "gaussians", "sigma")  # of a row, sent to the step logger
REFINE_COUNTS = ("clones", "splits", "prunes", "relocated", "added")  # of a refine event


class MetricsSink:
    """The CSV at ``csv_path`` (None: no file) and the ``step_logger`` (``log(step, {name: value})`` and
    ``close()``; None: none). Rows are written as they come, so the CSV can be watched while training runs."""

    def __init__(self, csv_path: str | Path | None = None, step_logger=None):
        self.csv_path = Path(csv_path) if csv_path else None
        self.step_logger = step_logger
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
