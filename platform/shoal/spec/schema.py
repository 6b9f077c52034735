"""The workload schema: what a user may write in a workload YAML.

Key names are the user-facing contract (README's "Workload reference"; where a
new setting goes: docs/architecture.md, "Where to add"). Sections reject unknown
keys; cross-field rules that need more than one section live in `checks.py`, so
that each error can name its own path.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveFloat,
    field_validator,
    model_validator,
)

from shoal.messages import Metric


class Section(BaseModel):
    # strict: `true` is not a step count and "400" is not a number; no inf or nan anywhere
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True, allow_inf_nan=False)


def _list_as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value  # YAML has lists, not tuples


# Sane ranges: far beyond any real run, short of the values that only a typo or a hostile
# file gives (and that would overflow a tensor size, a seed or MLflow's doubles).
STEPS = 10**9
ROWS = 1 << 24
WORKERS = 100_000
DAY_S = 86_400.0
Count = Annotated[int, Field(gt=0, le=STEPS)]  # steps, intervals, repetitions
Rows = Annotated[int, Field(gt=0, le=ROWS)]  # rows and tokens per batch or group
Workers = Annotated[int, Field(gt=0, le=WORKERS)]
Degree = Annotated[int, Field(ge=-1, le=WORKERS)]  # -1: fill the rest of the world
FloatPair = Annotated[tuple[float, float], BeforeValidator(_list_as_tuple)]

# `package.module:name`: dotted identifiers only (no paths, no relative imports)
IMPORT_TARGET = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


class HfModelSpec(Section):
    """A Hugging Face transformers model, from a config (nothing downloaded) or a local folder."""

    class_: str = Field("AutoModelForCausalLM", alias="class")  # an Auto class or a model class
    config: dict[str, Any] | None = None  # AutoConfig.for_model(**config): needs model_type
    path: str | None = None  # a folder written by save_pretrained, read with local_files_only

    @model_validator(mode="after")
    def _one_source(self) -> HfModelSpec:
        if (self.config is None) == (self.path is None):
            raise ValueError("give exactly one of 'config' (build from it) or 'path' (a local folder)")
        return self


class ModelSpec(Section):
    family: str | None = None
    target: str | None = None
    hf: HfModelSpec | None = None
    args: dict[str, Any] = Field(default_factory=dict)
    task: Literal["classify", "lm", "custom"] | None = None
    loss: str | None = None  # module:function(outputs, batch) -> the loss (replaces the task's)

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        given = [name for name in ("family", "target", "hf") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'family' (built-in), 'target' (module:Class) or 'hf'")
        return self

    @field_validator("target", "loss")
    @classmethod
    def _importable_shape(cls, value: str | None) -> str | None:
        if value is not None and not IMPORT_TARGET.fullmatch(value):
            shown = value if len(value) <= 80 else f"{value[:77]}..."
            raise ValueError(f"must look like 'package.module:name' (got {shown!r})")
        return value


class DatasetPath(Section):
    path: str


class DataSpec(Section):
    builtin: Literal["digits", "pytext"] | None = None
    train: DatasetPath | None = None
    val: DatasetPath | None = None
    batch_size: Rows = 32
    cache: Literal["auto"] | bool = "auto"  # keep val batches in worker memory (auto: local, < 512 MB)
    # rows each lane of the epoch plan mixes at a time (data/epoch_plan.py); 0: no shuffle at all
    shuffle_buffer: int = Field(8192, ge=0, le=ROWS)
    accept_changed_data: bool = False  # resume although the data's manifest digest changed
    columns: dict[str, str] = Field(default_factory=dict)  # data column -> forward argument
    seq_len: Rows | None = None  # language models: tokens per example (windows of seq_len + 1)
    text_column: str = "text"  # raw text (jsonl, parquet): the field that holds the text
    rows_per_group: Rows = 1024  # packed text: rows per parquet row group

    @model_validator(mode="after")
    def _one_source(self) -> DataSpec:
        if (self.builtin is None) == (self.train is None):
            raise ValueError("give exactly one of 'builtin' or 'train: {path: ...}'")
        if self.builtin is not None and self.val is not None:
            raise ValueError("'val' goes with 'train'; a builtin corpus brings its own split")
        return self


class OptimizerSpec(Section):
    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1.0e-3, gt=0, le=100)
    weight_decay: float = Field(0.0, ge=0, le=100)
    momentum: float = Field(0.9, ge=0, lt=1)
    betas: FloatPair = (0.9, 0.999)
    # torch's kernel for the update (worker/optim.py). auto: fused where it fits the parameters,
    # the for-loop where they sit on more than one device mesh (tp), else torch's default.
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = "auto"

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"each beta must be in [0, 1) (got {list(betas)})")
        return betas


class ScheduleSpec(Section):
    warmup_steps: int = Field(0, ge=0, le=STEPS)
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class TrainSpec(Section):
    max_steps: Count | None = None
    epochs: Count | None = None
    global_batch_size: Rows | None = None
    # auto: bf16 where the workers' device runs it natively, else fp32 (shoal/hardware.py)
    precision: Literal["fp32", "bf16", "fp16", "fp8", "auto"] = "fp32"
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    compile: bool = False
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    clip_grad_norm: float | None = Field(None, gt=0, le=1e9)
    eval_every: Count | None = None
    eval_batches: Count | None = None  # the first N val batches, all workers; None: all
    seed: int = Field(0, ge=0, lt=2**63)

    @model_validator(mode="after")
    def _one_length(self) -> TrainSpec:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("give exactly one of 'max_steps' or 'epochs'")
        return self


class ParallelSpec(Section):
    """A strategy by name, or explicit degrees whose product is the world size (-1 fills)."""

    strategy: Literal["ddp", "fsdp", "hsdp", "tp", "pp", "hybrid"] | None = None
    dp_replicate: Degree | None = None
    dp_shard: Degree | None = None
    tp: Degree | None = None
    pp: Degree | None = None
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    microbatches: Rows | None = None  # per pipeline step; default: the number of stages


class ElasticWorkers(Section):
    min: Workers
    max: Workers

    @model_validator(mode="after")
    def _ordered(self) -> ElasticWorkers:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class ScalingSpec(Section):
    workers: Workers | ElasticWorkers = 1
    gpus_per_worker: float = Field(0, ge=0, le=64)
    cpus_per_worker: float = Field(1, gt=0, le=4096)
    threads_per_worker: int | None = Field(None, gt=0, le=4096)
    resize_interval_s: float = Field(30, gt=0, le=DAY_S)  # elastic runs: how often to look for room to grow

    def worker_range(self) -> tuple[int, int]:
        if isinstance(self.workers, ElasticWorkers):
            return self.workers.min, self.workers.max
        return self.workers, self.workers


class KeepBest(Section):
    metric: str  # a metric at checkpoint steps: val/loss, val/accuracy or train/loss
    mode: Literal["min", "max"] = "min"


class CheckpointSpec(Section):
    every_steps: Count | None = None
    keep: int = Field(3, gt=0, le=100_000)  # the latest K; keep_best adds the best one by a metric
    keep_best: KeepBest | None = None
    async_: bool = Field(False, alias="async")  # write in the background while training goes on
    # A save due while the previous async one is still being written: wait for it, or skip
    # this one (an event says so). Never two writers at once.
    if_busy: Literal["wait", "skip"] = "wait"
    storage: str = "./shoal_runs"  # a directory, or s3://bucket/prefix
    endpoint: str | None = None  # S3-compatible endpoint URL for s3:// storage


class FailureSpec(Section):
    max_restarts: int = Field(3, ge=0, le=100_000)
    hang_timeout_s: float = Field(600, gt=0, le=7 * DAY_S)
    # a restart that cannot place its workers in time retries smaller
    worker_start_timeout_s: float = Field(30, gt=0, le=DAY_S)
    on_nan: Literal["fail", "skip", "rollback"] = "fail"
    # non-finite steps skipped or rolled back before the run fails
    max_nan_steps: int = Field(3, ge=0, le=STEPS)


class RegisterSpec(Section):
    name: str = Field(min_length=1)  # the MLflow registered model
    alias: str | None = None  # set on the new version (models:/NAME@ALIAS)

    @field_validator("alias")
    @classmethod
    def _alias_mlflow_allows(cls, alias: str | None) -> str | None:
        if alias is not None and re.fullmatch(r"(?i)latest|v\d+", alias):
            raise ValueError(f"MLflow reserves the alias {alias!r} ('latest' and v<number>)")
        return alias


class TrackingSpec(Section):
    experiment: str | None = None
    uri: str | None = None
    register_: RegisterSpec | None = Field(None, alias="register")  # the final model's registered name
    log_model: bool = True  # log the final weights as an MLflow model at the end of a run


class TokenizerSpec(Section):
    """How raw text becomes token ids."""

    type: Literal["byte", "hf", "train_bpe", "tiktoken_file"] = "byte"
    path: str | None = None  # hf: a folder or tokenizer.json; tiktoken_file: a .tiktoken file
    vocab_size: Rows | None = None  # train_bpe: the vocabulary to learn

    @model_validator(mode="after")
    def _fits_type(self) -> TokenizerSpec:
        if self.type in ("hf", "tiktoken_file") and self.path is None:
            raise ValueError(f"tokenizer type {self.type} needs 'path'")
        if self.type == "train_bpe" and self.vocab_size is None:
            raise ValueError("tokenizer type train_bpe needs 'vocab_size'")
        if self.type == "byte" and (self.path is not None or self.vocab_size is not None):
            raise ValueError("the byte tokenizer takes neither 'path' nor 'vocab_size'")
        return self


class StragglerSpec(Section):
    factor: float = Field(1.5, gt=1, le=1e6)  # busier than the other workers' median by this factor...
    steps: Count = 5  # ...for this many steps in a row
    min_gap_s: float = Field(0.02, ge=0, le=DAY_S)  # ...and by at least this many seconds
    # A link: a rank's round trip to the head above `factor` x the others' median by this much
    link_min_gap_s: float = Field(0.02, ge=0, le=DAY_S)
    link_probe_every_s: float = Field(5.0, ge=0, le=DAY_S)  # how often each rank times it; 0: never


class ProfileSpec(Section):
    start_step: Count  # the first profiled optimizer step
    steps: int = Field(3, gt=0, le=10_000)


class MonitorSpec(Section):
    stragglers: StragglerSpec = Field(default_factory=StragglerSpec)
    # each rank's own series (worker/R/..., gpu/R/..., data/R/...) up to this many ranks;
    # beyond, their min / median / max and arg-max rank, and the stragglers' own series
    per_rank_up_to: int = Field(8, ge=0, le=1_000_000)
    profile: ProfileSpec | None = None  # a torch.profiler trace of these steps, per rank
    tensorboard: bool = False  # also write TensorBoard event files (and traces) under the run dir


class SearchDomain(Section):
    """One searched setting: exactly one of the keys below."""

    choice: list[Any] | None = Field(None, min_length=1)  # sampled
    grid: list[Any] | None = Field(None, min_length=1)  # every value, crossed with the other grids
    uniform: FloatPair | None = None
    loguniform: Annotated[tuple[PositiveFloat, PositiveFloat], BeforeValidator(_list_as_tuple)] | None = None
    randint: Annotated[tuple[int, int], BeforeValidator(_list_as_tuple)] | None = None  # both bounds included

    @model_validator(mode="after")
    def _exactly_one(self) -> SearchDomain:
        given = [k for k in DOMAIN_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(DOMAIN_KINDS)} (got {given or 'none'})")
        bounds = getattr(self, given[0])
        if given[0] in ("uniform", "loguniform", "randint") and bounds[0] > bounds[1]:
            raise ValueError(f"{given[0]}: low ({bounds[0]}) must be <= high ({bounds[1]})")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in DOMAIN_KINDS if getattr(self, k) is not None)

    @property
    def values(self) -> list[Any]:
        """The values a trial may get (lists) or the two bounds (ranges)."""
        return list(getattr(self, self.kind))


DOMAIN_KINDS = ("choice", "grid", "uniform", "loguniform", "randint")


class SweepSpec(Section):
    space: dict[str, SearchDomain] = Field(min_length=1)  # dotted spec path -> domain
    metric: str = Metric.VAL_LOSS.value
    mode: Literal["min", "max"] = "min"
    samples: int = Field(8, gt=0, le=100_000)  # trials (with grids: repetitions of the whole grid)
    max_concurrent: int = Field(2, gt=0, le=WORKERS)
    scheduler: Literal["fifo", "asha", "pbt"] = "asha"
    searcher: Literal["random", "grid", "optuna"] = "random"
    grace_period: Count | None = None  # asha: steps before a trial may be stopped
    reduction_factor: float = Field(2.0, gt=1, le=1000)  # asha: keep 1/this many at each rung
    perturbation_interval: Count | None = None  # pbt: steps between exploits


class Workload(Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", max_length=100)
    model: ModelSpec
    data: DataSpec
    tokenizer: TokenizerSpec | None = None  # raw text only; token data needs none
    train: TrainSpec
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    failure: FailureSpec = Field(default_factory=FailureSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    monitor: MonitorSpec = Field(default_factory=MonitorSpec)
    sweep: SweepSpec | None = None  # used by `shoal sweep`; `shoal run` trains the base values

    def resolved(self) -> dict[str, Any]:
        """The spec as plain data, every default filled in, keys as the user writes them."""
        return self.model_dump(mode="json", by_alias=True)
