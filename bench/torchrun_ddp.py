"""Baseline 1: the idiomatic hand-written script, run with
`torchrun --nproc-per-node 2 bench/torchrun_ddp.py --steps N --precision fp32`.

Parquet windows loaded with pyarrow into a tensor, DistributedSampler, DDP,
AdamW, optional bf16 autocast. Nothing else.
"""

from __future__ import annotations

import argparse
import time
from contextlib import nullcontext

import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from bench.common import (
    GPT_ARGS,
    LR,
    MICRO_BATCH,
    data_dir,
    process_start,
    steady_tokens_per_s,
    steady_window,
    train_step,
    write_result,
)
from shoal.models.gpt import GPT


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--out")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    table = pq.read_table(data_dir() / "train", columns=["tokens"])
    tokens = torch.from_numpy(table.column("tokens").combine_chunks().flatten().to_numpy())
    tokens = tokens.view(table.num_rows, -1)
    sampler = DistributedSampler(TensorDataset(tokens), shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(tokens), batch_size=MICRO_BATCH, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = DistributedDataParallel(GPT(**GPT_ARGS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.precision == "bf16" else nullcontext()

    step_ends, first_step_at = [], None
    for (batch,) in loader:
        loss = train_step(model, optimizer, batch.long(), autocast)
        step_ends.append(time.time())
        first_step_at = first_step_at or step_ends[-1]
        if len(step_ends) == args.steps:
            break
    if rank == 0:
        tokens_per_step = MICRO_BATCH * world * GPT_ARGS["seq_len"]
        write_result(
            args.out,
            tokens_per_s=steady_tokens_per_s(step_ends, tokens_per_step),
            first_step_s=first_step_at - process_start(),
            final_loss=loss.item(),
            **steady_window(step_ends),
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
