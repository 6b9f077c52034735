"""Evaluation with sharded parameters (FSDP) when the validation batches do not split evenly
over the ranks: every forward pass gathers the parameters across the ranks, so a rank with
fewer batches runs fillers. Without them, a 2-rank FSDP run with `eval_batches: 1` aborted
in gloo ("Received data size doesn't match expected size") at its first evaluation."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.unit.local_context import parquet_manifest
from tests.unit.parallel_harness import SEQ, free_port, gpt_spec

ROWS = 12  # batches of 2 rows per rank: 6 in the whole set


def _validation_rows() -> torch.Tensor:
    return torch.randint(0, 256, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(7))


def _evaluate_on_rank(rank: int, world: int, port: int, manifest_json: str, out: str) -> None:
    from shoal.worker.engine import Engine
    from shoal.worker.steps import ValidationShare, evaluate

    torch.set_num_threads(1)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    strategy = {"strategy": "fsdp"} if world > 1 else {"strategy": "ddp"}
    workload = gpt_spec(strategy).workload
    engine = Engine(workload, "lm", world, torch.device("cpu"), total_steps=1, accumulation=1)
    results = {}
    for max_batches in (1, 3, None):  # 1 and 3 batches leave a rank short; 6 split evenly
        share = ValidationShare(manifest_json, engine, micro=2, max_batches=max_batches, keep=False)
        fillers = list(share.fillers())
        batches = list(share.batches())
        results[max_batches] = (
            evaluate(engine, batches, "lm", world, iter(fillers)),
            len(batches),
            len(fillers),
        )
    torch.save(results, Path(out) / f"rank{rank}.pt")
    if world > 1:
        dist.barrier()  # no rank tears gloo down while another still reads the last collective
        dist.destroy_process_group()


def test_ranks_with_fewer_validation_batches_run_fillers_and_every_row_counts_once(tmp_path: Path) -> None:
    manifest_json = parquet_manifest(tmp_path / "val", {"tokens": _validation_rows()}, rows_per_group=4)
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        out.mkdir()
        if world == 1:
            _evaluate_on_rank(0, 1, 0, manifest_json, str(out))
        else:
            args = (world, free_port(), manifest_json, str(out))
            mp.start_processes(_evaluate_on_rank, args=args, nprocs=world, start_method="spawn", join=True)
    single = torch.load(tmp_path / "w1" / "rank0.pt")
    ranks = [torch.load(tmp_path / "w2" / f"rank{r}.pt") for r in range(2)]
    # (batches, fillers) per rank: the short rank makes up the difference, nobody else runs any
    assert [r[1][1:] for r in ranks] == [(0, 1), (1, 0)]
    assert [r[3][1:] for r in ranks] == [(1, 1), (2, 0)]
    assert [r[None][1:] for r in ranks] == [(3, 0), (3, 0)]
    for max_batches in (1, 3, None):
        loss = single[max_batches][0]["val/loss"]
        for rank in ranks:  # the fillers' rows are not counted: the same loss as one rank over the same rows
            assert abs(rank[max_batches][0]["val/loss"] - loss) < 1e-4, (max_batches, rank, loss)
