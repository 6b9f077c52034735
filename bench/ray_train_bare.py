"""Baseline 2: an idiomatic Ray Train V2 script (`python bench/ray_train_bare.py`).

Ray Data reads the parquet shards, TorchTrainer runs 2 workers with
prepare_model (DDP), each worker iterates its shard with iter_torch_batches and
reports once at the end (reporting every step is throttled by Ray Train).
"""

from __future__ import annotations

import argparse
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
    model = prepare_model(GPT(**GPT_ARGS))
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
        tokens_per_step = MICRO_BATCH * WORKERS * GPT_ARGS["seq_len"]
        write_result(
            config["out"],
            tokens_per_s=steady_tokens_per_s(step_ends, tokens_per_step),
            first_step_s=step_ends[0] - config["start"],
            final_loss=loss.item(),
            **steady_window(step_ends),
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out")
    args = parser.parse_args()
    # Ray Data needs CPUs beside the two workers, or reading hangs (see FACTS.md).
    ray.init(address="local", num_cpus=WORKERS + 2, include_dashboard=False)
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={
            "steps": args.steps,
            "precision": args.precision,
            "out": args.out,
            "start": process_start(),
        },
        scaling_config=ray.train.ScalingConfig(num_workers=WORKERS),
        datasets={"train": ray.data.read_parquet(str(data_dir() / "train"))},
    )
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
