"""Baseline 2: an idiomatic Ray Train V2 script (`python bench/ray_train_bare.py`).

Ray Data reads the parquet shards, TorchTrainer runs 2 workers with
prepare_model (DDP), each worker iterates its shard with iter_torch_batches and
reports once at the end (reporting every step is throttled by Ray Train).
`--workers`, `--gpt` (model args as JSON) and `--address` (an existing cluster)
serve the control-plane bench (bench/control_plane.py).
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext

import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer, prepare_model

from bench.common import (
    GPT_ARGS,
    LR,
    MICRO_BATCH,
    WORKERS,
    data_dir,
    process_start,
    steady_tokens_per_s,
    steady_window,
    train_step,
    write_result,
)
from shoal.models.gpt import GPT


def train_fn(config: dict) -> None:
    torch.manual_seed(0)
    model = prepare_model(GPT(**config["gpt"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    bf16 = config["precision"] == "bf16"
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    shard = ray.train.get_dataset_shard("train")
    step_ends = []
    for batch in shard.iter_torch_batches(batch_size=MICRO_BATCH, drop_last=True):
        loss = train_step(model, optimizer, batch["tokens"].long(), autocast)
        step_ends.append(time.time())
        if len(step_ends) == config["steps"]:
            break
    if ray.train.get_context().get_world_rank() == 0:  # same machine: write the result directly
        tokens_per_step = MICRO_BATCH * config["workers"] * config["gpt"]["seq_len"]
        write_result(
            config["out"],
            tokens_per_s=steady_tokens_per_s(step_ends, tokens_per_step),
            first_step_s=step_ends[0] - config["start"],
            final_loss=loss.item(),
            step_ends=step_ends,
            **steady_window(step_ends),
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out")
    parser.add_argument("--workers", type=int, default=WORKERS)
    parser.add_argument("--gpt", type=json.loads, default=GPT_ARGS, help="the model's args, as JSON")
    parser.add_argument("--address", help="an existing Ray cluster (default: start one here)")
    args = parser.parse_args()
    if args.address:
        ray.init(address=args.address)
    else:  # Ray Data needs CPUs beside the workers, or reading hangs (see FACTS.md)
        ray.init(address="local", num_cpus=args.workers + 2, include_dashboard=False)
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={
            "steps": args.steps,
            "precision": args.precision,
            "out": args.out,
            "start": process_start(),
            "gpt": args.gpt,
            "workers": args.workers,
        },
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers),
        datasets={"train": ray.data.read_parquet(str(data_dir(args.gpt["seq_len"]) / "train"))},
    )
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
