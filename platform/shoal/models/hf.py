"""Hugging Face transformers models, built from a config or loaded from a local folder, never
fetched from the hub.

`model.hf: {class: C, config: {model_type: llama, ...}}` builds C from the config alone;
`model.hf: {class: C, path: DIR}` loads a folder written by `save_pretrained` with
`local_files_only=True`. What would reach the hub is refused before launch, with the reason:
a path that is not a local folder, a class transformers does not have, remote code
(`auto_map`, `trust_remote_code`). The hub is switched off for this process anyway.

The task follows the class: causal LM -> lm, sequence classification -> classify (unless
model.task says otherwise). The forward returns a `ModelOutput`; models/outputs.py takes the
logits from it, and an LM's logits have the config's `vocab_size`.

Tensor parallelism: a model opts in through models/protocol.py's ParallelModel, which an HF
class does not implement. For the Llama family shoal builds its own subclass of the HF class
(`LlamaForCausalLM` below): the same class name (save_pretrained writes it into config.json),
modules, parameter names and forward, plus the protocol. Its plan is the config's own
`base_model_tp_plan` (q/k/v, gate and up column-wise; o and down row-wise; embeddings, norms
and the head replicated, so tied embeddings need nothing special). Llama's attention takes the
number of heads from the local shape, so it runs on the shards as it is. Pipeline stages are
refused: the base model's forward computes the rotary embeddings and the mask for every layer.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import transformers
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from shoal.models.errors import ModelError
from shoal.spec.schema import HfModelSpec

# huggingface_hub reads HF_HUB_OFFLINE once, when first imported, and asks the constant before
# every request: set both (the variable for processes started from this one).
os.environ["HF_HUB_OFFLINE"] = "1"
hub_constants.HF_HUB_OFFLINE = True

REMOTE_CODE_KEYS = ("auto_map", "trust_remote_code")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
CONFIG_KWARGS = ("model_type", "attn_implementation")  # taken by every config, not fields


@dataclass(frozen=True)
class HfModelFacts:
    """What `shoal validate` learns from building the model on the meta device."""

    task: str
    vocab_size: int | None
    max_positions: int | None


def as_spec(hf: HfModelSpec | Mapping[str, Any]) -> HfModelSpec:
    """The typed section, from the spec or from its `model_dump()` (the worker's copy)."""
    return hf if isinstance(hf, HfModelSpec) else HfModelSpec.model_validate(dict(hf))


# -- where the model comes from -----------------------------------------------------------
def local_folder(path: str) -> Path:
    """A folder written by save_pretrained (config.json and weights), with no remote code."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ModelError(
            f"'{path}' is not an existing local folder; shoal never downloads (a hub name "
            "would): give a folder written by save_pretrained, or build from model.hf.config",
            where="model.hf.path",
        )
    config_file = folder / "config.json"
    try:
        settings = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {config_file}: {exc}", where="model.hf.path") from None
    refuse_remote_code(settings, "model.hf.path", f"{config_file} names")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise ModelError(
            f"'{path}' holds no weights (none of {', '.join(WEIGHT_FILES)})", where="model.hf.path"
        )
    return folder


def refuse_remote_code(settings: Mapping[str, Any], where: str, what: str) -> None:
    found = [key for key in REMOTE_CODE_KEYS if key in settings]
    if found:
        raise ModelError(
            f"{what} remote code ({', '.join(found)}): shoal runs only the model classes that "
            "transformers ships, never code from the hub",
            where=where,
        )


def named_class(name: str) -> type:
    """The transformers class `name`: an Auto class or a model class."""
    found = getattr(transformers, name, None) if name.isidentifier() else None
    if isinstance(found, type) and (issubclass(found, PreTrainedModel) or hasattr(found, "_model_mapping")):
        return found
    raise ModelError(
        f"transformers {transformers.__version__} has no model class '{name}' (e.g. "
        "AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaForCausalLM)",
        where="model.hf.class",
    )


def hf_config(spec: HfModelSpec) -> PretrainedConfig:
    if spec.path is not None:
        folder = local_folder(spec.path)
        try:
            return AutoConfig.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError, TypeError, StrictDataclassError) as exc:
            raise ModelError(
                f"cannot read {folder / 'config.json'}: {_first_line(exc)}", where="model.hf.path"
            ) from None
    settings = dict(spec.config or {})
    refuse_remote_code(settings, "model.hf.config", "model.hf.config names")
    config_class = _config_class(named_class(spec.class_), settings)
    unknown = [key for key in settings if not _is_setting(config_class, key)]
    if unknown:
        raise ModelError(
            f"{config_class.__name__} has no setting {', '.join(map(repr, unknown))}",
            where=f"model.hf.config.{unknown[0]}",
        )
    settings.pop("model_type", None)
    try:
        return config_class(**settings)
    except (ValueError, TypeError, StrictDataclassError) as exc:
        raise ModelError(_first_line(exc), where="model.hf.config") from None


def _config_class(named: type, settings: Mapping[str, Any]) -> type[PretrainedConfig]:
    model_type = settings.get("model_type")
    if model_type is None:
        if hasattr(named, "_model_mapping"):
            raise ModelError(
                f"{named.__name__} picks the model by model.hf.config.model_type (llama, gpt2, ...)",
                where="model.hf.config",
            )
        return named.config_class
    if model_type not in CONFIG_MAPPING:
        raise ModelError(
            f"transformers {transformers.__version__} has no model_type {model_type!r}",
            where="model.hf.config.model_type",
        )
    return CONFIG_MAPPING[model_type]


def _is_setting(config_class: type[PretrainedConfig], key: str) -> bool:
    return (
        key in CONFIG_KWARGS
        or key in {f.name for f in fields(config_class)}
        or key in config_class.attribute_map
        or hasattr(config_class, key)  # properties such as num_labels
    )


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


# -- the class and the task ------------------------------------------------------------------
def hf_model_class(spec: HfModelSpec, config: PretrainedConfig | None = None) -> type[nn.Module]:
    """The class that gets built: an Auto class resolved for the config's model type, or the
    named class; shoal's tensor-parallel subclass where there is one."""
    config = config if config is not None else hf_config(spec)
    named = named_class(spec.class_)
    if hasattr(named, "_model_mapping"):
        try:
            cls = named._model_mapping[type(config)]
        except KeyError:
            raise ModelError(
                f"{named.__name__} has no model for model_type {config.model_type!r}",
                where="model.hf.class",
            ) from None
    elif isinstance(config, named.config_class):
        cls = named
    else:
        raise ModelError(
            f"{named.__name__} takes a {named.config_class.model_type!r} config, not {config.model_type!r}",
            where="model.hf.class",
        )
    return TENSOR_PARALLEL.get(cls, cls)


def class_task(cls: type) -> str | None:
    """lm for a causal language model, classify for sequence classification, else None."""
    for task, names in (
        ("lm", modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        ("classify", modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
    ):
        if any(cls.__name__ in ((n,) if isinstance(n, str) else n) for n in names.values()):
            return task
    return None


def check_hf(spec: HfModelSpec, declared_task: str | None) -> HfModelFacts:
    """Everything `shoal validate` can know without weights: the source is local, the class
    exists and takes the config, the model builds (on meta), and its task."""
    config = hf_config(spec)
    cls = hf_model_class(spec, config)
    task = declared_task or class_task(cls)
    if task is None:
        raise ModelError(
            f"cannot tell the task of {cls.__name__}: set model.task (classify, lm or custom)",
            where="model.task",
        )
    if class_task(cls) == "classify" and getattr(config, "pad_token_id", None) is None:
        raise ModelError(
            f"{cls.__name__} classifies each row by its last token that is not padding, and "
            "needs pad_token_id to find it: set model.hf.config.pad_token_id",
            where="model.hf.config",
        )
    try:
        with torch.device("meta"):
            cls(config)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ModelError(f"{cls.__name__} cannot be built: {_first_line(exc)}", where="model.hf") from None
    positions = getattr(config, "max_position_embeddings", None)
    return HfModelFacts(task, getattr(config, "vocab_size", None), positions)


# -- building ---------------------------------------------------------------------------------
def build_hf_model(hf: HfModelSpec | Mapping[str, Any]) -> nn.Module:
    """The model, with fresh weights from the config or the folder's weights in float32. On
    the meta device (cost tracing) nothing is read: the folder's config is enough."""
    spec = as_spec(hf)
    config = hf_config(spec)
    cls = hf_model_class(spec, config)
    if spec.path is None or torch.get_default_device().type == "meta":
        model = cls(config)
    else:
        model = cls.from_pretrained(spec.path, config=config, local_files_only=True, dtype=torch.float32)
    if "use_cache" in inspect.signature(model.forward).parameters:
        model.register_forward_pre_hook(without_cache, with_kwargs=True)
    return model


def without_cache(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """Training keeps no key/value cache: it costs memory, and a recomputed (activation-
    checkpointed) layer would append to it twice. A caller that asks for one still gets it."""
    kwargs.setdefault("use_cache", False)
    return args, kwargs


def parallel_args(hf: HfModelSpec) -> dict[str, Any]:
    """What ParallelModel.parallel_problems takes for a Hugging Face model: its config."""
    return hf_config(hf).to_dict()


# -- tensor parallelism for the Llama family ---------------------------------------------------
class LlamaFamilyParallel:
    """models/protocol.py's ParallelModel for HF Llama-family classes; `args` of
    parallel_problems is the model's config as a dict (`parallel_args`)."""

    config_class: type[PretrainedConfig]
    config: PretrainedConfig
    base_model_prefix: str

    @classmethod
    def parallel_problems(cls, args: Mapping[str, Any], tp: int, stages: int) -> list[tuple[str, str]]:
        given = {**cls.config_class().to_dict(), **args}
        heads = given["num_attention_heads"]
        sizes = {
            "num_attention_heads": heads,
            "num_key_value_heads": given.get("num_key_value_heads") or heads,
            "intermediate_size": given["intermediate_size"],
        }
        problems = [
            ("parallel.tp", f"model.hf.config.{name} ({size}) is not divisible by tp ({tp})")
            for name, size in sizes.items()
            if tp > 1 and size % tp
        ]
        if stages > 1:
            problems.append(("parallel.pp", PIPELINE_REFUSAL))
        return problems

    def tensor_parallel_plan(self) -> dict[str, Any]:
        # Lazy: torch.distributed.tensor takes most of a second to import; validate never shards.
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        plan = {}
        # The config class's plan, not the instance's: with tied embeddings transformers adds
        # the embedding to it, to match its sharded head; shoal keeps both replicated.
        for path, style in type(self.config).base_model_tp_plan.items():
            if style not in styles:
                raise ModelError(f"{type(self).__name__}'s tensor-parallel plan has style {style!r}")
            plan[f"{self.base_model_prefix}.{path}"] = styles[style]()
        return plan

    def pipeline_stage(self, stage: int, num_stages: int) -> nn.Module:
        raise ModelError(PIPELINE_REFUSAL, where="parallel.pp")

    def fp8_filter(self, module: nn.Module, fqn: str) -> bool:
        return not fqn.endswith(("lm_head", "score"))  # the heads stay in high precision


PIPELINE_REFUSAL = (
    "Hugging Face models do not run as pipeline stages: the base model's forward computes the "
    "rotary embeddings and the attention mask for all its layers at once; use tp, fsdp or both"
)


class LlamaForCausalLM(LlamaFamilyParallel, transformers.LlamaForCausalLM):
    """transformers' LlamaForCausalLM, with tensor parallelism (see the module's docstring)."""


class LlamaForSequenceClassification(LlamaFamilyParallel, transformers.LlamaForSequenceClassification):
    """transformers' LlamaForSequenceClassification, with tensor parallelism."""


TENSOR_PARALLEL: dict[type, type[nn.Module]] = {
    transformers.LlamaForCausalLM: LlamaForCausalLM,
    transformers.LlamaForSequenceClassification: LlamaForSequenceClassification,
}
