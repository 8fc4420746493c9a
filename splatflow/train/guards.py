"""The training step's guards: gradient health after the first backward pass, and NaN/Inf in the loss or the model.

Two policies, one interface (the loop calls the same methods whichever runs):

* :class:`StepChecks` (the CPU): every step reads its loss back and checks the parameters at once; a read costs
  nothing there.
* :class:`DeferredChecks` (a GPU run): a step reads nothing back, so the host queues the next step while the GPU
  runs this one. A non-finite loss still never reaches the parameters: fused Adam skips that step's update on the
  device (its ``found_inf``). The flags accumulate on the device and :meth:`DeferredChecks.settle` reads them,
  with the logged row's numbers, in one transfer, whenever the loop is about to read or save the model.
"""

from __future__ import annotations

import math

import torch

from splatflow.pipeline.errors import UserError

NAN_CHECKED = ("means", "opacities", "scales")  # the groups whose NaN/Inf the step checks (after the strategy)


class GradientHealthError(UserError):
    """The first backward pass left positions, colours or opacities without any gradient."""


class StepChecks:
    """Check every step at once (see the module docstring)."""

    deferred = False

    def __init__(self):
        self.grad_checked = False  # the gradient health check runs on the first backward pass only

    # ------------------------------------------------------------------------------------------ gradient health
    def check_connected(self, loss: torch.Tensor, view_name: str) -> None:
        """Before the first backward: the loss must depend on the Gaussians at all."""
        if not self.grad_checked and not loss.requires_grad:
            raise GradientHealthError(
                f"the training loss does not depend on the Gaussians at all (view {view_name}): the render "
                "was detached from the parameters. Training would run and learn nothing, so it stops here.")

    def check_gradients(self, view_name: str, params: dict) -> None:
        """After the first backward: all-zero gradients mean the loss does not reach the Gaussians (``params``: the
        tensors the step differentiated, the sparse step's row copies or the model's parameters)."""
        if self.grad_checked:
            return
        self.grad_checked = True
        dead = [k for k in ("means", "sh0", "opacities")
                if params[k].grad is None or not bool(params[k].grad.abs().sum() > 0)]
        if dead:
            raise GradientHealthError(
                f"after the first backward pass the gradients of {', '.join(dead)} are all zero (view "
                f"{view_name}): the loss is not connected to the Gaussians (a detached render?) or no Gaussian is "
                "visible from the cameras (check the SfM model's cameras and points in data/<scene>/undistorted). "
                "Training would run and learn nothing, so it stops here.")

    # ------------------------------------------------------------------------------------------ non-finite values
    def check_loss(self, loss: torch.Tensor, optimizers: dict, step: int, view_name: str) -> None:
        """Before the backward pass: a non-finite loss raises ``FloatingPointError``."""
        self._loss = float(loss.detach())
        if not math.isfinite(self._loss):
            raise FloatingPointError(f"loss is {self._loss} at step {step} (view {view_name})")

    @torch.no_grad()
    def check_params(self, params: dict, step: int) -> None:
        """After the update: NaN/Inf in a checked group raises (any such entry makes its group's sum non-finite:
        one check, one host sync)."""
        sums = torch.stack([params[k].sum() for k in NAN_CHECKED])
        if not bool(torch.isfinite(sums).all()):
            bad = [k for k, v in zip(NAN_CHECKED, sums.tolist()) if not math.isfinite(v)]
            raise FloatingPointError(f"parameters {', '.join(bad)} became NaN/Inf at step {step}")

    def values(self, loss: torch.Tensor, l1: torch.Tensor, ssim: torch.Tensor) -> dict:
        """The step's row values: numbers."""
        return {"loss": self._loss, "l1": float(l1.detach()), "ssim": float(ssim.detach())}

    def settle(self, row: dict | None, step: int) -> None:
        """Nothing is deferred."""


class DeferredChecks(StepChecks):
    """Check on the device and read back only when the loop reads the model (see the module docstring)."""

    deferred = True

    def __init__(self):
        super().__init__()
        self._bad: torch.Tensor | None = None  # [2] bool on the device: a non-finite loss / parameter since settle
        self._bad_from = 0  # the first step not yet settled
        self._now = False  # this step checks at once (optimizers without found_inf)

    def check_loss(self, loss, optimizers, step, view_name) -> None:
        # found_inf exists only in torch's fused Adam, which every run's optimizers are (optim.adam)
        self._now = not all(o.defaults.get("fused") for o in optimizers.values())
        if self._now:
            return super().check_loss(loss, optimizers, step, view_name)
        self._loss_bad = ~torch.isfinite(loss.detach())
        found_inf = self._loss_bad.float()  # fused Adam skips its update (and its step count) where this is 1
        for opt in optimizers.values():
            opt.found_inf = found_inf

    @torch.no_grad()
    def check_params(self, params, step) -> None:
        if self._now:
            return super().check_params(params, step)
        sums = torch.stack([params[k].sum() for k in NAN_CHECKED])
        bad = torch.stack([self._loss_bad, ~torch.isfinite(sums).all()])
        self._bad = bad if self._bad is None else self._bad | bad

    def values(self, loss, l1, ssim) -> dict:
        if self._now:
            return super().values(loss, l1, ssim)
        return {"loss": loss.detach(), "l1": l1.detach(), "ssim": ssim.detach()}  # device scalars, read at settle

    def settle(self, row: dict | None, step: int) -> None:
        """Read back what the steps since the last call left on the device, in one transfer: raise
        ``FloatingPointError`` if a loss or a checked parameter group went NaN/Inf, and turn ``row``'s device
        scalars into numbers. ``step`` is the step just run (0-based, not yet counted), so a non-finite value is
        caught at most ``log_every`` steps late, as a CPU run catches it at once."""
        keys = [k for k in ("loss", "l1", "ssim") if row is not None and isinstance(row.get(k), torch.Tensor)]
        if self._bad is None and not keys:
            return
        parts = ([self._bad.float()] if self._bad is not None else []) + [row[k].float().reshape(1) for k in keys]
        vals = torch.cat(parts).tolist()  # the one host sync
        bad, first, last = self._bad is not None, self._bad_from, step  # (steps first..last, 0-based)
        self._bad, self._bad_from = None, step + 1
        if bad and vals[0]:
            raise FloatingPointError(f"the loss became NaN/Inf at one of steps {first} to {last}")
        if bad and vals[1]:
            raise FloatingPointError(f"parameters became NaN/Inf at one of steps {first} to {last}")
        for k, v in zip(keys, vals[2 if bad else 0:]):
            row[k] = v
