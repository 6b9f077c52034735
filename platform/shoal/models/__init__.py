"""Built-in model families and user models (`module:Class`)."""

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
    "build_model",
    "check_args",
    "count_parameters",
    "model_class",
    "model_task",
]
