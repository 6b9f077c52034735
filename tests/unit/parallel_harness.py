"""Runs the real worker Engine on N gloo ranks (torch.multiprocessing), no Ray.

Every rank reads its own slice of fixed global batches, the way Ray Data splits
rows; ranks that share a data-parallel slot (tp x pp) rebuild the slot's batch
through `Engine.combine`. Each rank writes its losses, full weights and shard
sizes to `out_dir/rank{r}.pt`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shoal.spec.schema import Workload

STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16


@dataclass
class Case:
    """One harness run: a workload (built through the schema), the accumulation steps of
    each rank, and optionally a checkpoint to write after training or load instead."""

    workload: Workload
    accumulation: int = 1
    checkpoint_io: dict[str, str] | None = None  # {"mode": "save" | "load", "dir": ...}


def gpt_spec(
    parallel: dict[str, Any],
    precision: str = "fp32",
    accumulation: int = 1,
    activation_checkpointing: str = "none",
    compile_model: bool = False,
) -> Case:
    model = {
        "family": "gpt",
        "args": {"n_layers": 4, "d_model": 32, "n_heads": 4, "seq_len": SEQ, "tie_embeddings": False},
    }
    return model_spec(model, parallel, precision, accumulation, activation_checkpointing, compile_model)


def llama_spec(parallel: dict[str, Any], activation_checkpointing: str = "none") -> Case:
    """A tiny Hugging Face Llama from its config, with grouped-query attention (4 query heads,
    2 key/value heads) and tied embeddings."""
    config = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": SEQ,
        "tie_word_embeddings": True,
    }
    model = {"hf": {"class": "LlamaForCausalLM", "config": config}}
    return model_spec(model, parallel, activation_checkpointing=activation_checkpointing)


def model_spec(
    model: dict[str, Any],
    parallel: dict[str, Any],
    precision: str = "fp32",
    accumulation: int = 1,
    activation_checkpointing: str = "none",
    compile_model: bool = False,
) -> Case:
    workload = Workload.model_validate(
        {
            "name": "harness",
            "model": model,
            "data": {"builtin": "pytext"},  # not read: the harness makes its own batches
            "train": {
                "max_steps": STEPS,
                "global_batch_size": GLOBAL_BATCH,
                "seed": 3,
                "precision": precision,
                "activation_checkpointing": activation_checkpointing,
                "compile": compile_model,
                "clip_grad_norm": 1.0,
                # SGD with momentum: sharded optimizer state, without Adam's amplification of
                # float-level noise in near-zero gradients (which would blur the comparison).
                "optimizer": {"name": "sgd", "lr": 0.5, "weight_decay": 0.1, "momentum": 0.9},
                "schedule": {"warmup_steps": 1, "decay": "cosine", "min_lr_ratio": 0.1},
            },
            "parallel": parallel,
        }
    )
    return Case(workload, accumulation)


def global_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def _slot_of(engine: Any, rank: int) -> tuple[int, int, int, int]:
    """(data-parallel slot, slots, index within the slot's model-parallel group, group size)."""
    dims = engine.dims
    if engine.mesh is None:
        return 0, 1, 0, 1
    replicate = engine.mesh["dp_replicate"].get_local_rank()
    shard = engine.mesh["dp_shard"].get_local_rank()
    return replicate * dims.dp_shard + shard, dims.dp, engine.mp_ranks.index(rank), len(engine.mp_ranks)


def _my_rows(batch: torch.Tensor, slot: int, slots: int, member: int, members: int) -> torch.Tensor:
    rows = batch.shape[0] // slots
    mine = batch[slot * rows : (slot + 1) * rows]
    part = rows // members
    return mine[member * part : (member + 1) * part]


def run_rank(rank: int, world: int, port: int, case: Case, out_dir: str) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from shoal.worker.checkpoint import format as checkpoint_format
    from shoal.worker.engine import Engine, StepLoss
    from shoal.worker.parallel.dims import local_numel
    from shoal.worker.reporting import StepStats

    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    accumulation = case.accumulation
    engine = Engine(
        case.workload,
        "lm",
        world,
        torch.device("cpu"),
        total_steps=STEPS,
        accumulation=accumulation,
        compile_cache=str(Path(out_dir) / "compile_cache"),
    )
    stats = StepStats(world, interval_s=1e9, rank=rank)
    slot, slots, member, members = _slot_of(engine, rank)
    losses = []
    io = case.checkpoint_io or {}
    if io.get("mode") == "load":  # resharding: a checkpoint written at another world size
        checkpoint_format.restore(Path(io["dir"]), engine.parts, engine.optimizers, engine.schedulers, rank)
    else:
        for batch in global_batches():
            rows = _my_rows(batch, slot, slots, member, members)
            micro = [{"tokens": chunk} for chunk in rows.chunk(accumulation)]
            # as the trainer does on CPU: the stats leave with the last backward pass (with
            # plain DDP, inside its gradient all-reduce: what the equivalence tests then check)
            shared = []

            def share(step: StepLoss, shared: list = shared) -> None:
                shared.append(stats.start(step.loss, step.weight, ride=engine.stats_ride))

            local = engine.forward_backward([engine.combine(b) for b in micro], after_forward=share)
            engine.optimizer_step()
            losses.append(stats.finish(shared[0] if shared else stats.start(local.loss, local.weight)).loss)
    if io.get("mode") == "save":
        state = {"world_size": world, "scheduler": engine.schedulers[0].state_dict()} if rank == 0 else None
        checkpoint_format.save(Path(io["dir"]), engine.parts, engine.optimizers, rank, state)
    full = StateDictOptions(full_state_dict=True)
    weights, optim = {}, {}
    flat_full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    for part, optimizer in zip(engine.parts, engine.optimizers, strict=True):
        weights.update({k: v.detach().clone() for k, v in get_model_state_dict(part, options=full).items()})
        optim.update(get_optimizer_state_dict(part, optimizer, options=flat_full))
    local_params = sum(local_numel(p) for part in engine.parts for p in part.parameters())
    local_optim = sum(
        local_numel(v)
        for o in engine.optimizers
        for s in o.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    torch.save(
        {
            "losses": losses,
            "weights": weights,
            "optim": {k: v.clone() if torch.is_tensor(v) else v for k, v in optim.items()},
            "lr": engine.lr,
            "local_params": local_params,
            "local_optim": local_optim,
            "parameters": engine.parameters,
            "skipped": engine.precision.skipped_steps,
            "stats_carried": engine.stats_ride.carried if engine.stats_ride else 0,
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(case: Case, world: int, out_dir: Path) -> list[dict[str, Any]]:
    out_dir.mkdir(parents=True, exist_ok=True)
    if world == 1:
        run_rank(0, 1, 0, case, str(out_dir))
    else:
        mp.start_processes(
            run_rank,
            args=(world, free_port(), case, str(out_dir)),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
