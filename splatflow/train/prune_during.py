"""Pruning inside the last part of training (``train.prune_during``): the steps after each cut are its recovery.

Why: the prune stage's phased pruning (:mod:`splatflow.compress.prune`, after LightGaussian) fine-tunes the model after
every phase; six recoveries of 1,000-3,000 steps cost about twice the training itself (docs/experiments.md). Training
already ends with steps that only refine a fixed set of Gaussians (densification stops at
``densify.refine_stop_fraction``). Cutting the model during those steps lets them serve as the recovery, and each
step after a cut is cheaper because fewer Gaussians are drawn, so pruning costs about its scoring (progressive
pruning during training, as in Trick-GS, rather than LightGaussian's prune-then-recover).

What is kept from the prune stage: the ranking (the removal cost, :func:`splatflow.compress.scoring.removal_scores`,
each cut made in ``score_rounds`` geometric sub-cuts re-scored in between) and the early stop against a PSNR floor on
TRAINING views. What differs: the cuts are fractions of the count at the first cut (geometric from 1 down to
``keep_final``), the score is summed over ``score_views`` evenly spaced training views instead of all of them
(a Gaussian that no scored view sees costs zero to remove, so the scored views must cover the scene: the
default 16 of the demo's 31 orbit views are ~23 degrees apart, well inside the 65-degree field of view), and a rejected phase is undone by restoring the model AND its optimizer state from a
snapshot taken just before its cut (training then continues without further cuts).

The policy is this small object with explicit state (a :class:`~splatflow.train.hooks.Policy`), called by the
training loop after every step (:meth:`PruneDuring.after_step`, with the run's
:class:`~splatflow.train.state.GaussianState`, whose snapshot undoes a cut) and once when training ends
(:meth:`PruneDuring.finish`); its state is part of the training checkpoint, so a resumed run cuts and judges
exactly as an uninterrupted one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from splatflow.pipeline.config import PruneDuringConfig
from splatflow.pipeline.errors import UserError
from splatflow.gaussians.model import Splats
from splatflow.compress.scoring import Camera, removal_scores, top_indices, val_indices
from splatflow.train.hooks import LoopContext, Policy
from splatflow.train.state import GaussianState

log = logging.getLogger("splatflow.train")


def cut_steps(cfg: PruneDuringConfig, max_steps: int) -> list[int]:
    """The training steps (counted as completed steps) after which each cut is made: ``phases`` evenly spaced
    steps from ``start_fraction`` to ``end_fraction`` of ``max_steps``.

    Raises a UserError naming the keys when two cuts would fall on the same step (too few steps for the phases).
    """
    a, b = cfg.start_fraction * max_steps, cfg.end_fraction * max_steps
    steps = [int(round(a + (b - a) * k / (cfg.phases - 1))) if cfg.phases > 1 else int(round(a))
             for k in range(cfg.phases)]
    if steps[0] < 1 or any(s1 <= s0 for s0, s1 in zip(steps, steps[1:])) or steps[-1] >= max_steps:
        raise UserError(f"params.yaml: train.prune_during: {cfg.phases} cuts between steps {int(a)} and {int(b)} "
                        f"of {max_steps} would not fall on distinct steps before the end ({steps}); lower "
                        "train.prune_during.phases or widen start_fraction..end_fraction")
    return steps


def judge_steps(cfg: PruneDuringConfig, max_steps: int) -> list[int]:
    """The step at which each phase is judged: the next cut's step, and for the last phase one cut interval
    after its cut (half the remaining steps with a single phase), never past ``max_steps``. Judging a phase soon
    after its cut, not at the end of training, leaves the steps after it to the model an undo restores."""
    steps = cut_steps(cfg, max_steps)
    gap = steps[1] - steps[0] if len(steps) > 1 else max(1, (max_steps - steps[0]) // 2)
    return steps[1:] + [min(max_steps, steps[-1] + gap)]


def keep_fractions(cfg: PruneDuringConfig) -> list[float]:
    """Cumulative keep fraction of each cut, of the count at the first cut: ``keep_final ** (k / phases)``,
    k = 1..phases (3 phases to 0.1: 0.464, 0.215, 0.100), so every cut removes the same share of what is left."""
    return [cfg.keep_final ** (k / cfg.phases) for k in range(1, cfg.phases + 1)]


def sub_cut_sizes(n_cur: int, n_keep: int, rounds: int) -> list[int]:
    """Sizes after each of ``rounds`` geometric sub-cuts from ``n_cur`` to ``n_keep`` (the last is ``n_keep``)."""
    return [n_keep if r == rounds else int(round(n_cur * (n_keep / n_cur) ** (r / rounds)))
            for r in range(1, rounds + 1)]


def accepted(val_psnr: float, ref_psnr: float, max_drop_db: float) -> bool:
    """A phase is kept while its validation PSNR stays within ``max_drop_db`` of the PSNR before the first cut."""
    return bool(val_psnr >= ref_psnr - max_drop_db)


# --------------------------------------------------------------------------------------------- the policy


@dataclass
class PruneDuring(Policy):
    """Cuts the training run's model at :func:`cut_steps` down to :func:`keep_fractions` and judges each phase.

    A phase is judged at :func:`judge_steps` (or when training ends, if that comes first): accepted if the
    validation PSNR then is within ``max_psnr_drop_db`` of the PSNR just before the first cut, otherwise undone
    (snapshot) and pruning stops; the restored model trains on for the remaining steps. While cuts are pending the
    plateau stop's clock is held, so training reaches the last cut.
    """

    cfg: PruneDuringConfig
    steps: list[int]
    fractions: list[float]
    judge_at: list[int]
    done: int = 0  # cuts made
    judged: int = 0  # phases judged (accepted, or the one rejected)
    n_ref: int | None = None  # Gaussians at the first cut
    psnr_ref: float | None = None  # validation PSNR just before the first cut
    stop_reason: str | None = None
    records: list[dict] = field(default_factory=list)
    snap: dict | None = None  # the model before the latest cut, until that phase is judged
    max_steps: int = 0

    @classmethod
    def from_config(cls, cfg: PruneDuringConfig, max_steps: int) -> "PruneDuring":
        return cls(cfg, cut_steps(cfg, max_steps), keep_fractions(cfg), judge_steps(cfg, max_steps),
                   max_steps=max_steps)

    def lr_factor(self, step: int) -> float:
        """Multiplier of the position learning rate at ``step``: ``recovery_lr_boost`` just after a cut, falling
        linearly to 1 at the next cut (the end of training after the last one); 1 before the first cut and after
        an undone phase.

        Why: by the time the cuts come the position rate has decayed to a few percent of its start, so the
        survivors can barely move into the gaps the removed Gaussians leave; the prune stage's recoveries needed
        a rate near a third of the initial one (docs/experiments.md, Pruning). A pure function of the policy's state,
        so a resumed run uses the same rates.
        """
        boost = self.cfg.recovery_lr_boost
        if boost == 1.0 or self.done == 0 or self.stop_reason is not None:
            return 1.0
        start = self.steps[self.done - 1]
        end = self.steps[self.done] if self.done < len(self.steps) else max(self.max_steps, start + 1)
        if not start <= step < end:
            return 1.0
        return 1.0 + (boost - 1.0) * (1.0 - (step - start) / (end - start))

    @property
    def pending(self) -> bool:
        """Cuts still to make (no early stop yet)."""
        return self.stop_reason is None and self.done < len(self.steps)

    # ------------------------------------------------------------------------------------------ hooks
    def _due(self, step: int) -> tuple[bool, bool]:
        """(a phase to judge, a cut to make) after ``step`` completed steps."""
        due_judge = self.stop_reason is None and self.judged < self.done and step >= self.judge_at[self.judged]
        return due_judge, self.pending and step >= self.steps[self.done]

    def acts_at(self, step: int) -> bool:
        """Whether :meth:`after_step` validates, judges or cuts after ``step`` completed steps."""
        return any(self._due(step))

    def after_step(self, gs: GaussianState, step: int, ctx: LoopContext) -> None:
        """Called after every training step (``step`` completed steps)."""
        due_judge, due_cut = self._due(step)
        if not (due_judge or due_cut):
            if self.pending:
                ctx.stopper.hold(step)  # hold the plateau clock until the last cut
            return
        val = ctx.validate()
        if due_judge and not self._judge(gs, ctx, val, step):
            return
        if due_cut:
            if self.done == 0:
                self.psnr_ref = val
                self.n_ref = gs.n
            self._cut(gs, ctx, step)

    def finish(self, gs: GaussianState, step: int, ctx: LoopContext) -> None:
        """Called once when training ends (max_steps or plateau): judge the last phase, drop the snapshot."""
        if self.judged < self.done and self.stop_reason is None:
            self._judge(gs, ctx, ctx.validate(), step)
        if self.pending:  # training ended before a scheduled cut (e.g. a resumed run with other steps)
            self.stop_reason = (f"training ended at step {step} before the cut at step "
                                f"{self.steps[self.done]}")
        self.snap = None

    # ------------------------------------------------------------------------------------------ work
    def _judge(self, gs: GaussianState, ctx: LoopContext, val: float, step: int) -> bool:
        rec = self.records[-1]
        ok = accepted(val, self.psnr_ref, self.cfg.max_psnr_drop_db)
        rec.update({"val_psnr": val, "judged_at_step": step, "accepted": ok})
        self.judged += 1
        if not ok:
            gs.restore(self.snap)
            self.stop_reason = (f"phase {rec['phase']} (keep {rec['keep_fraction']:.3f}) gave validation PSNR "
                                f"{val:.2f} dB at step {step}, more than {self.cfg.max_psnr_drop_db:g} dB below "
                                f"{self.psnr_ref:.2f} dB before the first cut; restored the model before that cut")
            log.info("prune during training: %s", self.stop_reason)
            ctx.stopper.restart()  # the model just changed: the plateau is measured afresh
        self.snap = None
        return ok

    def _cut(self, gs: GaussianState, ctx: LoopContext, step: int) -> None:
        t0 = time.perf_counter()
        frac = self.fractions[self.done]
        n_cur = gs.n
        n_keep = max(1, int(round(frac * self.n_ref)))
        self.snap = gs.snapshot()
        deg = ctx.sh_degree(step)
        n_views = len(ctx.views)
        ids = val_indices(n_views, self.cfg.score_views) if self.cfg.score_views else list(range(n_views))
        cams, targets = [], []
        for i in ids:
            img, K = ctx.cache.get(i, 1.0)  # [H, W, 3], [3, 3]
            cams.append(Camera(ctx.views[i].world_to_cam, K, img.shape[1], img.shape[0]))
            targets.append(img)
        candidate = gs.splats().detach()
        rows = torch.arange(n_cur, device=gs.device)  # [N] the survivors' rows in the current model
        if n_keep < n_cur:
            for n_sub in sub_cut_sizes(n_cur, n_keep, self.cfg.score_rounds):
                idx = top_indices(removal_scores(candidate, deg, cams, targets), n_sub).to(gs.device)
                candidate = candidate.select(idx)
                rows = rows.index_select(0, idx)
            gs.keep(rows)
        self.done += 1
        rec = {"phase": self.done, "step": step, "keep_fraction": round(frac, 6), "gaussians": n_keep,
               "gaussians_before": n_cur, "score_views": len(ids), "score_seconds": round(time.perf_counter() - t0, 3),
               "val_psnr": None, "accepted": None}
        self.records.append(rec)
        log.info("prune during training: step %d cut %d -> %d Gaussians (%.1f%% of %d) in %.1f s", step, n_cur,
                 n_keep, 100.0 * n_keep / self.n_ref, self.n_ref, rec["score_seconds"])
        if ctx.step_logger is not None:
            ctx.step_logger.log(step, {"prune_gaussians": float(n_keep), "prune_phase": float(self.done)})
        ctx.stopper.restart()  # the model just changed: the plateau is measured afresh

    # ------------------------------------------------------------------------------------------ state
    def report(self) -> dict:
        """What the train stage's metrics and the prune stage's verification read."""
        kept = [r for r in self.records if r["accepted"]]
        return {"cut_steps": list(self.steps), "judge_steps": list(self.judge_at), "keep_fractions": [round(f, 6) for f in self.fractions],
                "gaussians_before": self.n_ref, "val_psnr_before": self.psnr_ref,
                "gaussians_after": kept[-1]["gaussians"] if kept else self.n_ref,
                "phases": [dict(r) for r in self.records], "cuts": self.done,
                "stopped_early": int(self.stop_reason is not None and self.judged > len(kept)),  # 0/1
                "stop_reason": self.stop_reason}

    def state_dict(self) -> dict:
        return {"done": self.done, "judged": self.judged, "n_ref": self.n_ref, "psnr_ref": self.psnr_ref,
                "stop_reason": self.stop_reason, "records": [dict(r) for r in self.records], "snap": self.snap,
                "steps": list(self.steps), "report": self.report()}

    def load_state_dict(self, d: dict) -> None:
        if list(d["steps"]) != list(self.steps):
            raise UserError(f"checkpoint's prune_during cut steps {d['steps']} differ from {self.steps}; "
                            "the run cannot resume (delete the checkpoint to start afresh)")
        self.done, self.judged = int(d["done"]), int(d["judged"])
        self.n_ref, self.psnr_ref, self.stop_reason = d["n_ref"], d["psnr_ref"], d["stop_reason"]
        self.records, self.snap = [dict(r) for r in d["records"]], d["snap"]


def verify(record: dict, splats: Splats, val_psnr: float) -> dict:
    """The prune stage's report for a model pruned during training: nothing is cut again; the count must be the
    one training recorded, and the validation PSNR on the prune stage's views is measured (``val_psnr``)."""
    splats = Splats.of(splats)
    n = splats.n
    if record.get("gaussians_after") != n:
        raise UserError(f"models/<scene>/train/ckpt.pt: holds {n} Gaussians but its prune_during record says "
                        f"{record.get('gaussians_after')}; rerun the train stage")
    per_gaussian_mib = splats.bytes_per_gaussian / 2**20
    n0 = int(record.get("gaussians_before") or n)
    return {
        "gaussians_before": n0, "gaussians_after": n,
        "size_mb_before": round(n0 * per_gaussian_mib, 4), "size_mb_after": round(n * per_gaussian_mib, 4),
        # the before/after PSNRs of training's phases are on training's early-stop views (train.early_stop)
        "val_psnr_before": record.get("val_psnr_before"), "val_psnr_after": val_psnr,
        "phases": record.get("phases", []), "stopped_early": int(bool(record.get("stopped_early"))),
        "stop_reason": ("pruned during training (train.prune_during): verified and copied"
                        + (f"; {record['stop_reason']}" if record.get("stop_reason") else "")),
    }
