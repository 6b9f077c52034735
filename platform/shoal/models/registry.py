"""Model families by name, and user models by `package.module:Class`."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from shoal.models.errors import ModelError

BUILTIN: dict[str, str] = {
    "cnn": "shoal.models.cnn:ConvNet",
    "mlp": "shoal.models.mlp:MLP",
    "gpt": "shoal.models.gpt:GPT",
}
TASKS = ("classify", "lm", "custom")
HF_PACKAGES = ("transformers", "huggingface_hub", "tokenizers", "safetensors")


def import_target(target: str) -> type[nn.Module]:
    """Import `package.module:Class`, looking in the working directory too.

    The `shoal` console script, unlike `python -m`, does not put the working
    directory on sys.path; users expect their `my_models.py` beside the YAML.
    """
    module_name, _, attr = target.partition(":")
    module = _import_user_module(module_name)
    cls = getattr(module, attr, None)
    if cls is None:
        raise ModelError(f"module '{module_name}' has no attribute '{attr}'")
    if not (inspect.isclass(cls) and issubclass(cls, nn.Module)):
        raise ModelError(f"'{target}' is not a torch.nn.Module subclass")
    return cls


def _import_user_module(module_name: str) -> ModuleType:
    """Import a user's module (the working directory searched too); whatever goes wrong in
    it, a ModelError naming the module and what it raised."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    importlib.invalidate_caches()
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f"cannot import module '{module_name}' ({exc})") from None
    except (Exception, SystemExit) as exc:  # the user's module itself failed: say so in one line
        where = ""
        if isinstance(exc, SyntaxError) and exc.lineno:
            where = f" at {exc.filename}:{exc.lineno}"
        problem = f"{type(exc).__name__}{where}: {exc}"
        raise ModelError(f"importing module '{module_name}' raised {problem}") from None


def model_class(family: str | None, target: str | None, hf: Any = None) -> type[nn.Module]:
    """The class a model spec builds: a built-in family, a user's `module:Class`, or a Hugging
    Face class (`hf`: the spec's model.hf section)."""
    if hf is not None:
        return hf_models().hf_model_class(hf_models().as_spec(hf))
    if family is not None:
        if family not in BUILTIN:
            raise ModelError(f"unknown family '{family}' (built-in: {', '.join(BUILTIN)})")
        return import_target(BUILTIN[family])
    if target is None:
        raise ModelError("the model spec names no family, target or hf")
    return import_target(target)


def hf_models() -> ModuleType:
    """models/hf.py, or a ModelError when the optional transformers is not installed."""
    try:
        # Lazy: transformers takes seconds to import and comes with the optional shoal[hf] extra.
        from shoal.models import hf
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in HF_PACKAGES:
            raise
        raise ModelError(
            f"model.hf needs {exc.name}, which is not installed: pip install 'shoal[hf]'", where="model.hf"
        ) from None
    return hf


def model_task(cls: type[nn.Module], declared: str | None) -> str:
    """The task a model trains on: the spec's `model.task`, else the class's `task`."""
    task = declared or getattr(cls, "task", None) or "classify"
    if task not in TASKS:
        raise ModelError(f"task must be one of {TASKS} (got {task!r})")
    return task


def import_loss(target: str) -> Callable[..., Any]:
    """`model.loss`: a `package.module:function(outputs, batch)` returning the loss."""
    module_name, _, attr = target.partition(":")
    module = _import_user_module(module_name)
    function = getattr(module, attr, None)
    if not callable(function):
        raise ModelError(f"module '{module_name}' has no function '{attr}'")
    try:
        inspect.signature(function).bind(None, None)
    except TypeError:
        raise ModelError(f"'{target}' must take two arguments: (outputs, batch)") from None
    except ValueError:  # a builtin without a signature: trust it
        pass
    return function


def model_config(model_cfg: dict[str, Any], seq_len: int | None) -> dict[str, Any]:
    """The model section with the data's window length: a model whose constructor takes
    `seq_len`, and whose args do not set it, gets the data's `seq_len`."""
    args = model_cfg.get("args", {})
    if seq_len is None or "seq_len" in args or model_cfg.get("hf") is not None:
        return model_cfg
    cls = model_class(model_cfg.get("family"), model_cfg.get("target"))
    if "seq_len" not in inspect.signature(cls).parameters:
        return model_cfg
    return {**model_cfg, "args": {**args, "seq_len": seq_len}}


# an annotation (or its string, under `from __future__ import annotations`) -> accepted types
ARG_TYPES: dict[Any, tuple[type, ...]] = {int: (int,), float: (int, float), bool: (bool,)}
ARG_TYPES.update({"int": (int,), "float": (int, float), "bool": (bool,)})
ARG_KINDS = {(int,): "an integer", (int, float): "a number", (bool,): "true or false"}


def check_args(cls: type[nn.Module], args: dict[str, Any]) -> None:
    """Args the constructor accepts: known names, the annotated scalar types (`true` is not an
    int), and the ranges a class declares in `arg_limits` (name -> (low, high), inclusive)."""
    signature = inspect.signature(cls)
    try:
        signature.bind(**args)
    except TypeError as exc:
        raise ModelError(f"{cls.__name__} does not accept these args: {exc}") from None
    limits: dict[str, tuple[float, float]] = getattr(cls, "arg_limits", {})
    for name, value in args.items():
        parameter = signature.parameters.get(name)
        wanted = ARG_TYPES.get(parameter.annotation) if parameter is not None else None
        if wanted and (not isinstance(value, wanted) or (bool not in wanted and isinstance(value, bool))):
            raise ModelError(f"must be {ARG_KINDS[wanted]} (got {value!r})", where=f"model.args.{name}")
        if name in limits and not isinstance(value, bool) and isinstance(value, (int, float)):
            low, high = limits[name]
            if not low <= value <= high:
                problem = f"must be in [{low:g}, {high:g}] for {cls.__name__} (got {value!r})"
                raise ModelError(problem, where=f"model.args.{name}")


def build_model(model_cfg: dict[str, Any]) -> nn.Module:
    if model_cfg.get("hf") is not None:
        return hf_models().build_hf_model(model_cfg["hf"])
    cls = model_class(model_cfg.get("family"), model_cfg.get("target"))
    try:
        return cls(**model_cfg.get("args", {}))
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{cls.__name__}({model_cfg.get('args', {})}) failed: {exc}") from None


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
