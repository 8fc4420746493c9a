"""One device per run: which backend and which ``torch.device`` a stage uses, what it was, and its GPU memory.

A stage resolves ``backend: auto|cpu|cuda`` ONCE, at its start (:func:`resolve`), and every tensor of the run lives
on the returned device: parameters, optimizer and strategy state, cameras, targets, blur/SSIM windows, masks and
noise. Images are decoded on the host (under the image cache's budget) and uploaded per use; checkpoints are
written with every tensor on the CPU, so a model trained on a GPU resumes and evaluates on a CPU and the other way
round (:func:`to_device` moves a loaded payload wherever it is needed).

:func:`run_record` is what a stage writes into its metrics and the MLflow run: the backend that ACTUALLY ran, the
device's name, the torch / gsplat / CUDA versions and, on a GPU, the peak allocated and reserved memory since
:func:`reset_peak_memory`.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any

import torch

from splatflow.pipeline.errors import UserError
from splatflow.render import resolve_backend


@dataclass(frozen=True)
class RunDevice:
    """The concrete backend (``"cpu"``, ``"cuda"`` or ``"torch"``) and the device its tensors live on."""

    backend: str
    device: torch.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


class GsplatUnavailableError(UserError):
    """A GPU is present but gsplat's CUDA kernels cannot be compiled or loaded."""


_GSPLAT_CHECKED = False


def check_gsplat_cuda() -> None:
    """Load gsplat's CUDA kernels once (the first call JIT-compiles them: needs ``nvcc`` and ``ninja``, takes
    minutes once, then loads from the torch extensions cache in seconds); a failure becomes a clear
    :class:`GsplatUnavailableError` naming the fix instead of a JIT traceback in the middle of training."""
    global _GSPLAT_CHECKED
    if _GSPLAT_CHECKED:
        return
    try:
        import gsplat  # noqa: F401
    except ImportError as e:
        raise GsplatUnavailableError(
            f"a CUDA GPU is present but gsplat is not installed ({e}). Install it into the project venv with "
            "`.venv/bin/python -m pip install --no-deps gsplat==1.5.3` (never without --no-deps: its dependencies "
            "would replace torch), or set train.backend, prune.backend and evaluate.backend to cpu in params.yaml."
        ) from None
    try:
        from gsplat.cuda._backend import _C
    except Exception as e:  # noqa: BLE001 - the JIT raises many kinds (OSError, RuntimeError, CalledProcessError)
        _C, err = None, f"{type(e).__name__}: {e}"
    else:
        err = "gsplat's JIT build returned no module"
    if _C is None:
        raise GsplatUnavailableError(
            f"a CUDA GPU is present but gsplat could not compile or load its CUDA kernels ({err}). gsplat compiles "
            "them on first use: it needs the CUDA toolkit's `nvcc` (the same major version as torch's CUDA, "
            f"torch {torch.__version__} uses CUDA {torch.version.cuda}) on PATH or in CUDA_HOME, `ninja` "
            "(`.venv/bin/python -m pip install ninja`) and a C++ compiler. Rerun with VERBOSE=1 to see the "
            "compiler's output, or set train.backend, prune.backend and evaluate.backend to cpu in params.yaml "
            "to train on the CPU. See docs/backends.md, 'Installing on a GPU machine'."
        ) from None
    _GSPLAT_CHECKED = True


def resolve(backend: str, *, check_kernels: bool = True) -> RunDevice:
    """The run's backend and device for a ``backend`` setting (``auto`` = CUDA when available, else CPU).

    ``cuda`` without a GPU raises :class:`splatflow.render.CudaUnavailableError` (a user error). With a GPU and
    ``check_kernels``, gsplat's kernels are loaded here, at the stage's start, so a broken toolchain is reported
    before any work is done.
    """
    name = resolve_backend(backend)
    if name == "cuda":
        if check_kernels:
            check_gsplat_cuda()
        return RunDevice("cuda", torch.device("cuda", torch.cuda.current_device()))
    return RunDevice(name, torch.device("cpu"))


def to_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` (tensors nested in dicts, lists and tuples) with every tensor moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_device(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_device(v, device) for v in obj)
    return obj




def gpu_memory_gib(device: torch.device) -> float | None:
    """The GPU's memory in GiB (one decimal), None for a device that is not a CUDA GPU."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)


def reset_peak_memory(dev: RunDevice | None = None) -> None:
    """Start counting a stage's peak GPU memory from now (no-op on the CPU)."""
    if dev is not None and dev.is_cuda:
        torch.cuda.reset_peak_memory_stats(dev.device)


def gsplat_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("gsplat")
    except Exception:  # noqa: BLE001 - not installed
        return None


def run_record(dev: RunDevice) -> dict:
    """What ran: backend, device name, versions and (on a GPU) peak memory in MiB since the last reset.

    Written into the stage's metrics JSON (``device`` block) and, flattened, logged to MLflow.
    """
    rec: dict[str, Any] = {
        "backend": dev.backend,
        "device": str(dev.device),
        "device_name": torch.cuda.get_device_name(dev.device) if dev.is_cuda else (platform.processor()
                                                                                  or platform.machine()),
        "torch": torch.__version__,
        "gsplat": gsplat_version(),
        "cuda": torch.version.cuda,
        "gpu_peak_allocated_mib": None,
        "gpu_peak_reserved_mib": None,
    }
    if dev.is_cuda:
        rec["gpu_peak_allocated_mib"] = round(torch.cuda.max_memory_allocated(dev.device) / 2**20, 1)
        rec["gpu_peak_reserved_mib"] = round(torch.cuda.max_memory_reserved(dev.device) / 2**20, 1)
    return rec


def synchronize(dev: RunDevice | torch.device) -> None:
    """Wait for the device's queued work (so a wall clock measures it); no-op on the CPU."""
    d = dev.device if isinstance(dev, RunDevice) else torch.device(dev)
    if d.type == "cuda":
        torch.cuda.synchronize(d)


__all__ = ["RunDevice", "GsplatUnavailableError", "check_gsplat_cuda", "resolve", "to_device",
           "reset_peak_memory", "run_record", "gsplat_version", "synchronize"]
