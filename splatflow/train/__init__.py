"""Training: progressive 3DGS training on CPU or CUDA.

``train(scene, cfg, ...)`` runs the full schedule (see :mod:`splatflow.train.loop`); ``finetune(splats, scene,
steps, cfg, sh_degree=...)`` is the densification-free recovery step the prune stage uses.
"""

from splatflow.train.recovery import finetune
from splatflow.train.guards import GradientHealthError
from splatflow.train.loop import Trainer, TrainResult, photometric_loss, train

__all__ = ["GradientHealthError", "Trainer", "TrainResult", "finetune", "photometric_loss", "train"]
