"""Train pipelines (TorchRec-style): plain, and overlapping the next batch's copy and ids.

Both take :class:`Batch` es whose sparse part is a KJT, a TensorDict (weights and variable
batch sizes included) or combined features, work with ``fxrec.optimize`` d models, and run
on one process or several (gloo/NCCL under torchrun).
"""

from __future__ import annotations

from fxrec.train.batch import Batch, move, transfer_count
from fxrec.train.pipeline import (
    PipelineError,
    PipelineStats,
    TrainPipelineBase,
    TrainPipelineSparseDist,
    bce_loss,
)

__all__ = [
    "Batch",
    "PipelineError",
    "PipelineStats",
    "TrainPipelineBase",
    "TrainPipelineSparseDist",
    "bce_loss",
    "move",
    "transfer_count",
]
