"""Step logging: live metrics of a running stage (``train/loss`` at step 120), buffered into few MLflow calls.

A stage's code asks for its logger with :func:`step_logger`; it logs into the run the stage tracker opened in this
process (:func:`splatflow.tracking.stage_tracking`), else into ``MLFLOW_RUN_ID``, else nowhere.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import warnings
from typing import Any

from splatflow.tracking.store import client, enabled

STEP_FLUSH_SECONDS = 2.0  # live enough for the UI, cheap enough (one log_batch costs ~20 ms)
STEP_FLUSH_ROWS = 500  # MLflow accepts at most 1000 metrics per log_batch


#: The stage tracker of the stage running in this process, set by the stage tracker while its stage runs.
_active: Any = None


def set_active(tracker: Any) -> None:
    """Called by the stage tracker: the step loggers made from now on log into ``tracker``'s run (None: none)."""
    global _active
    _active = tracker


class StepLogger:
    """Buffered live step metrics (``train/loss`` at step 120): flushed every ``STEP_FLUSH_SECONDS`` or
    ``STEP_FLUSH_ROWS`` values, and on ``close()``; a no-op when there is no run or tracking is off."""

    def __init__(self, stage: str, run_id: str | None, cl=None):
        self.stage, self.run_id, self.client = stage, run_id, cl
        self._buf: list = []
        self._last_flush = time.monotonic()
        self._failed = False
        self._lock = threading.Lock()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.run_id is None or self._failed:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        for k, v in metrics.items():
            v = float(v)
            if math.isfinite(v):
                self._buf.append(Metric(f"{self.stage}/{k}", v, ts, int(step)))
        if len(self._buf) >= STEP_FLUSH_ROWS or time.monotonic() - self._last_flush >= STEP_FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            buf, self._buf = self._buf, []
            self._last_flush = time.monotonic()
            if not buf or self.run_id is None or self._failed:
                return
            try:
                for i in range(0, len(buf), 1000):
                    self.client.log_batch(self.run_id, metrics=buf[i : i + 1000])
            except Exception as e:  # noqa: BLE001
                self._failed = True
                warnings.warn(f"splatflow tracking: step metrics disabled: {e}", stacklevel=2)

    def close(self) -> None:
        self.flush()
        with contextlib.suppress(ValueError):
            _LOGGERS.remove(self)


_LOGGERS: list[StepLogger] = []


def flush_all() -> None:
    """Send what every open step logger of this process still buffers (the stage shell calls it on exit)."""
    for lg in list(_LOGGERS):
        lg.flush()


def step_logger(stage: str) -> StepLogger:
    """The step logger of the stage running in this process (see docs/CONTRACTS.md "Tracking")."""
    if not enabled():
        return StepLogger(stage, None)
    active = _active
    if active is not None:
        if not active.active:
            return StepLogger(stage, None)
        lg = StepLogger(stage, active.run_id, active.client)
    else:
        run_id = os.environ.get("MLFLOW_RUN_ID") or None
        if run_id is None:
            return StepLogger(stage, None)
        try:
            lg = StepLogger(stage, run_id, client())
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"splatflow tracking: step metrics disabled: {e}", stacklevel=2)
            return StepLogger(stage, None)
    _LOGGERS.append(lg)
    return lg

