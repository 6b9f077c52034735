"""`shoal plan`: which layout, micro-batch and checkpointing fit a workload on N GPUs.

Candidates go simplest first (DDP, FSDP, HSDP, tensor parallel, pipeline);
for each, the largest micro-batch that fits without activation checkpointing,
else with it. The recommendation is the first candidate that fits without an
interconnect warning (else the first that fits at all).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import yaml

from shoal.data.sources import builtin_shapes, column_shapes, parquet_files, window_length
from shoal.errors import ShoalError
from shoal.hardware import resolve_auto, support
from shoal.models import ParallelModel, model_class, model_task
from shoal.models.cost import ModelCost, trace_cost
from shoal.models.objective import Objective
from shoal.models.registry import model_config
from shoal.plan.catalog import CATALOG, INTERCONNECTS, Gpu
from shoal.plan.memory import Estimate, Layout, Training, estimate
from shoal.spec.checks import check_batches, check_model, check_parallel
from shoal.spec.loader import Source, apply_overrides, read_yaml, validate_data
from shoal.spec.schema import Workload
from shoal.spec.sweep import with_values
from shoal.worker.batching import global_batch_size

RESERVED_BYTES = 1.5e9  # CUDA context, NCCL buffers: not available to tensors
USABLE_SHARE = 0.9  # allocator fragmentation and estimate error


class PlanError(ShoalError, ValueError):
    """Planner arguments or a workload the planner cannot reason about."""


@dataclass
class Option:
    layout: Layout
    micro: int = 0  # samples per data-parallel slot per micro-step
    accumulation: int = 0
    activation_checkpointing: str = "none"
    estimate: Estimate | None = None
    warnings: list[str] = field(default_factory=list)
    problem: str | None = None  # why this layout cannot run this workload at all

    @property
    def fits(self) -> bool:
        return self.problem is None


@dataclass
class Plan:
    gpu: Gpu
    gpus: int
    nodes: int
    interconnect: str
    cost: ModelCost
    training: Training
    global_batch: int
    usable_bytes: float
    options: list[Option]
    choice: Option | None
    asked_precision: str = "fp32"  # train.precision as written (`auto`: training.precision is its value)
    precision_warning: str | None = None  # the precision is emulated on this GPU, or cannot run


def sample_shapes(workload: Workload) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """One row's shape per column: a built-in corpus's known columns (pytext windows of
    data.seq_len, else model.args.seq_len, else the constructor's default), or the first
    local parquet file's schema."""
    data = workload.data
    if data.builtin is not None:
        seq_len = window_length(data.seq_len, workload.model.args) or _default_seq_len(workload)
        if data.builtin == "pytext" and not isinstance(seq_len, int):
            raise PlanError("shoal plan needs data.seq_len (or model.args.seq_len) for a language model")
        shapes = builtin_shapes(data.builtin, seq_len)
    else:
        files = parquet_files(data.train.path, "data.train.path")
        if "://" in files[0]:
            raise PlanError(
                "shoal plan reads a row of local parquet to learn the input shapes; "
                f"'{data.train.path}' is remote"
            )
        shapes = column_shapes(files[0])
    return {name: (shape, getattr(torch, dtype)) for name, (shape, dtype) in shapes.items()}


def _default_seq_len(workload: Workload) -> int | None:
    if workload.model.hf is not None:
        return None
    cls = model_class(workload.model.family, workload.model.target)
    default = inspect.signature(cls).parameters.get("seq_len")
    return default.default if default is not None and isinstance(default.default, int) else None


def model_cost(workload: Workload, precision: str) -> ModelCost:
    model = workload.model
    cls = model_class(model.family, model.target)
    task = model_task(cls, model.task)
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    objective = Objective.build(task, cls, workload.data.columns, model.loss)
    config = model_config(model.model_dump(), window_length(workload.data.seq_len, model.args))
    return trace_cost(config, objective, sample_shapes(workload), dtype)


def training_of(workload: Workload, activation_checkpointing: str | None = None) -> Training:
    train, parallel = workload.train, workload.parallel
    return Training(
        precision=train.precision,
        optimizer=train.optimizer.name,
        momentum=train.optimizer.momentum,
        activation_checkpointing=activation_checkpointing or train.activation_checkpointing,
        pipeline_microbatches=parallel.microbatches,
        pipeline_schedule=parallel.pp_schedule,
    )


def candidates(workload: Workload, gpus: int, nodes: int) -> list[Layout]:
    per_node = gpus // nodes
    layouts = [Layout("ddp", dp_replicate=gpus), Layout("fsdp", dp_shard=gpus)]
    if nodes > 1:
        layouts.append(Layout("hsdp", dp_replicate=nodes, dp_shard=per_node))
    cls = model_class(workload.model.family, workload.model.target)
    if issubclass(cls, ParallelModel) and gpus > 1:
        splits = [t for t in (8, 4, 2) if t <= per_node and gpus % t == 0]
        tp = next((t for t in splits if not cls.parallel_problems(workload.model.args, t, 1)), 1)
        if tp > 1:
            layouts.append(Layout("hybrid", dp_shard=gpus // tp, tp=tp))
        pp = nodes if nodes > 1 else 2
        if gpus % pp == 0:
            layouts.append(Layout("hybrid", dp_shard=gpus // pp, pp=pp))
    return layouts


def interconnect_warnings(layout: Layout, gpu: Gpu, per_node: int, interconnect: str) -> list[str]:
    warnings = []
    if layout.tp > per_node:
        warnings.append(f"TP degree {layout.tp} spans nodes: every layer all-reduces over the network")
    elif layout.tp > 1 and (interconnect == "pcie" or not gpu.nvlink):
        why = f"the {gpu.name} has no NVLink" if not gpu.nvlink else "the GPUs talk over PCIe"
        warnings.append(f"TP over PCIe ({why}): every layer all-reduces activations; expect it to be slow")
    crosses_nodes = layout.dp_shard > per_node
    if crosses_nodes and interconnect != "ib":
        warnings.append("FSDP shards across nodes without InfiniBand: every step all-gathers over Ethernet")
    return warnings


def _micro_choices(slot_batch: int, layout: Layout) -> list[int]:
    step = layout.tp * layout.pp  # every rank of a slot reads an equal share
    return [m for m in range(slot_batch, 0, -1) if slot_batch % m == 0 and m % step == 0]


def best_option(
    cost: ModelCost, layout: Layout, workload: Workload, global_batch: int, usable: float
) -> Option:
    option = Option(layout)
    if global_batch % layout.dp:
        option.problem = f"global batch {global_batch} does not split over {layout.dp} data-parallel slots"
        return option
    slot_batch = global_batch // layout.dp
    modes = ["none", "selective", "full"] if cost.blocks else ["none"]
    smallest: tuple[Estimate, int, str] | None = None
    for mode in modes:
        training = training_of(workload, mode)
        for micro in _micro_choices(slot_batch, layout):
            found = estimate(cost, layout, training, micro)
            smallest = (found, micro, mode) if smallest is None or found.peak < smallest[0].peak else smallest
            if found.peak <= usable:
                option.micro, option.activation_checkpointing, option.estimate = micro, mode, found
                option.accumulation = slot_batch // micro
                return option
    if smallest is None:
        option.problem = f"no micro-batch divides {slot_batch} rows into {layout.tp * layout.pp} equal reads"
        return option
    found, micro, mode = smallest  # the least it could need: shown, with why it does not fit
    option.micro, option.activation_checkpointing, option.estimate = micro, mode, found
    option.accumulation = slot_batch // micro
    option.problem = (
        f"needs {found.peak / 1e9:.1f} GB per GPU at best (micro-batch {micro}, {mode} checkpointing)"
    )
    return option


def spec_problem(workload: Workload, values: dict[str, Any]) -> str | None:
    """What the workload's own checks say of it with these values (the model's objections to
    a tp or pp degree, batches that do not split...), or None."""
    candidate = Workload.model_validate(with_values(workload.resolved(), values))
    source = Source("plan")
    task, issues = check_model(candidate, source)
    issues += check_parallel(candidate, source, task) + check_batches(candidate, source)
    return issues[0].message if issues else None


def check_arguments(gpu_key: str, gpus: int, nodes: int, interconnect: str | None) -> str:
    if gpu_key not in CATALOG:
        raise PlanError(f"--gpu {gpu_key!r} is not in the catalog ({', '.join(CATALOG)})")
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise PlanError(f"--gpus {gpus} must be a positive multiple of --nodes {nodes}")
    gpu = CATALOG[gpu_key]
    chosen = interconnect or ("nvlink" if gpu.nvlink else "pcie")
    if chosen not in INTERCONNECTS:
        raise PlanError(f"--interconnect {chosen!r} must be one of {', '.join(INTERCONNECTS)}")
    if chosen in ("nvlink", "ib") and not gpu.nvlink:
        raise PlanError(f"--interconnect {chosen}: the {gpu.name} has no NVLink (use pcie)")
    return chosen


def make_plan(
    workload: Workload, gpu_key: str, gpus: int, nodes: int = 1, interconnect: str | None = None
) -> Plan:
    link = check_arguments(gpu_key, gpus, nodes, interconnect)
    gpu = CATALOG[gpu_key]
    asked = workload.train.precision
    if asked == "auto":  # planned as the workers will resolve it on this GPU
        resolved = resolve_auto(gpu.hardware)
        workload = Workload.model_validate(with_values(workload.resolved(), {"train.precision": resolved}))
    cost = model_cost(workload, workload.train.precision)
    usable = USABLE_SHARE * (gpu.memory_bytes - RESERVED_BYTES)
    global_batch = global_batch_size(workload)
    options = []
    for layout in candidates(workload, gpus, nodes):
        option = best_option(cost, layout, workload, global_batch, usable)
        if option.fits:
            option.problem = spec_problem(workload, option_values(option, gpus, global_batch))
        option.warnings = interconnect_warnings(layout, gpu, gpus // nodes, link) if option.fits else []
        options.append(option)
    fitting = [o for o in options if o.fits]
    choice = next((o for o in fitting if not o.warnings), fitting[0] if fitting else None)
    warning = support(workload.train.precision, gpu.hardware).warning()
    training = training_of(workload)
    return Plan(gpu, gpus, nodes, link, cost, training, global_batch, usable, options, choice, asked, warning)


def recommended_values(plan: Plan) -> dict[str, Any]:
    """The spec values that apply the plan's choice (dotted paths, for spec.sweep.with_values)."""
    assert plan.choice is not None
    return option_values(plan.choice, plan.gpus, plan.global_batch)


def option_values(option: Option, gpus: int, global_batch: int) -> dict[str, Any]:
    layout = option.layout
    return {
        "scaling.workers": gpus,
        "scaling.gpus_per_worker": 1,
        "data.batch_size": option.micro // (layout.tp * layout.pp),
        "train.global_batch_size": global_batch,
        "train.activation_checkpointing": option.activation_checkpointing,
        "parallel.strategy": layout.strategy,
        # Every degree is set (None: the strategy decides), so that degrees the user's YAML
        # had for another layout do not linger: only HSDP's shard size and TP/PP are explicit.
        "parallel.dp_replicate": None,
        "parallel.dp_shard": layout.dp_shard if layout.strategy == "hsdp" else None,
        "parallel.tp": layout.tp if layout.tp > 1 else None,
        "parallel.pp": layout.pp if layout.pp > 1 else None,
    }


def planned_yaml(source_file: str, overrides: list[str], plan: Plan) -> str:
    """The user's YAML (with its --set) and the plan's choice applied, as YAML text."""
    raw, source = read_yaml(source_file)
    apply_overrides(raw, overrides, source)
    for path, value in recommended_values(plan).items():
        *parents, leaf = path.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    validate_data(raw, source)
    option = plan.choice
    assert option is not None and option.estimate is not None
    header = (
        f"# shoal plan: {plan.gpus} x {plan.gpu.key} on {plan.nodes} node(s), {plan.interconnect}; "
        f"{option.layout.describe()}, estimated {option.estimate.peak / 1e9:.1f} GB per GPU.\n"
    )
    return header + yaml.safe_dump(raw, sort_keys=False)
