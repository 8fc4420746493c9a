"""Hooks: how something outside training watches a run (the live viewer) without taking part in it.

A hook is any object with ``after_step(trainer, row)``. The loop calls :func:`after_step` once per finished step,
after the row was logged and before checkpoints or stops, outside the run's random generators: a hook reads the
trainer (``trainer.step``, ``trainer.params``, ``trainer.cfg``) and must change nothing, so a run with hooks
gives the parameters of the same run without them. ``row`` is the step's record (``step``, ``gaussians``,
``loss``; ``psnr`` only on the rows the loop logs). A hook that raises is dropped with one warning: watching a
run never stops it.
"""

from __future__ import annotations

import logging
from typing import Protocol

log = logging.getLogger("splatflow.train")


class TrainHook(Protocol):
    def after_step(self, trainer, row: dict) -> None: ...


def after_step(hooks: list, trainer, row: dict) -> None:
    """Call every hook's ``after_step``; a failing hook is removed from ``hooks`` (training goes on)."""
    for hook in list(hooks):
        try:
            hook.after_step(trainer, row)
        except Exception as e:  # noqa: BLE001 - a viewer's failure must not end a training run
            hooks.remove(hook)
            log.warning(f"training hook {type(hook).__name__} failed at step {trainer.step} and is switched off: "
                        f"{type(e).__name__}: {e}")
