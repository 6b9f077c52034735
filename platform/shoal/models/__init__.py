"""Built-in model families and user models (`module:Class`); the protocol a model
implements for tensor and pipeline parallelism (models/protocol.py)."""

from shoal.models.protocol import ParallelModel
from shoal.models.registry import (
    BUILTIN,
    ModelError,
    build_model,
    check_args,
    count_parameters,
    model_class,
    model_task,
)

__all__ = [
    "BUILTIN",
    "ModelError",
    "ParallelModel",
    "build_model",
    "check_args",
    "count_parameters",
    "model_class",
    "model_task",
]
