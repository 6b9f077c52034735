"""The step's stats riding DDP's first gradient all-reduce (worker/parallel/stats_ride.py)
on 2 gloo ranks (torch.multiprocessing, no Ray): the gradients are DDP's own average,
the stats come back as the float64 sums a separate all-reduce gives, per-rank values
exact to 48 bits, and where no bucket can carry them they take their own all-reduce."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shoal.worker.parallel.stats_ride import StatsRide, join64, ride_hook, split64
from shoal.worker.reporting import StepStats
from tests.unit.parallel_harness import free_port

WORLD = 2
ADDRESS = 3232235777.0  # 192.168.1.1 as a number: more bits than a float32 holds


def _stats(rank: int) -> torch.Tensor:
    """[a sum over ranks, each rank's slot, a sum float32 would round, inf on rank 1]."""
    slots = [0.0] * WORLD
    slots[rank] = ADDRESS + rank
    values = [1.1 + rank, *slots, 1.0 + 1e-9 * (rank + 1), float("inf") if rank else 0.0]
    return torch.tensor(values, dtype=torch.float64)


def _rank(rank: int, port: int, dtype: torch.dtype, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
        reference = [p.detach().clone() for p in model.parameters()]
        ride = StatsRide(WORLD)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.0001)  # several buckets: only the first carries
        ddp.register_comm_hook(ride, ride_hook)
        inputs = torch.randn(2 * WORLD, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
        results = {}
        for step in range(2):  # the second step runs on DDP's rebuilt buckets
            ddp.zero_grad()
            loss = ddp(inputs[rank * 2 : rank * 2 + 2]).square().mean()
            values = _stats(rank)
            work = ride.carry(values)
            loss.backward()
            work.wait()
            results[f"stats{step}"] = values.clone()
            results[f"grads{step}"] = [p.grad.clone() for p in ddp.parameters()]
        # no backward pass after the offer: the stats take their own all-reduce
        values = _stats(rank)
        ride.carry(values).wait()
        results["alone"] = values
        # StepStats with a ride: the loss averaged, every rank's slot in its row
        stats = StepStats(WORLD, interval_s=3600, rank=rank)
        loss = ddp(inputs[rank * 2 : rank * 2 + 2]).square().mean()
        per_rank = {"peak_mb": 100.0 + rank, "addr": ADDRESS + rank}
        shared = stats.start(float(rank + 1), 1.0, True, per_rank, ride=ride)
        loss.backward()
        reduced = stats.finish(shared)
        results["reduced"] = (reduced.loss, reduced.written, reduced.per_rank)
        results["carried"] = ride.carried
        # what each rank's gradients should be: the mean over both ranks' halves, on one process
        local = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)
        with torch.no_grad():
            for param, start in zip(local.parameters(), reference, strict=True):
                param.copy_(start)
        sum(local(inputs[r * 2 : r * 2 + 2]).square().mean() for r in range(WORLD)).div(WORLD).backward()
        results["expected_grads"] = [p.grad.clone() for p in local.parameters()]
        torch.save(results, Path(out) / f"rank{rank}.pt")
        dist.barrier()  # no rank tears gloo down while another still reads the last collective
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, dtype: torch.dtype) -> list[dict]:
    mp.start_processes(_rank, args=(free_port(), dtype, str(tmp_path)), nprocs=WORLD, start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def _expected_sums() -> torch.Tensor:
    return sum(_stats(r) for r in range(WORLD))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_ddps_average_and_the_stats_arrive_summed(tmp_path: Path, dtype: torch.dtype) -> None:
    ranks = _run(tmp_path, dtype)
    expected = _expected_sums()
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    for result in ranks:
        for step in range(2):
            stats = result[f"stats{step}"]
            assert stats.dtype == torch.float64
            # each rank's slot exact (bf16 buckets carry nothing: a plain float64 all-reduce)
            assert stats[1:3].tolist() == [ADDRESS, ADDRESS + 1]
            assert stats[0].item() == pytest.approx(expected[0].item(), rel=1e-7)
            assert stats[3].item() - 2.0 == pytest.approx(3e-9, rel=1e-3)  # float32 alone says 2.0
            assert stats[4].item() == float("inf")
            for got, want in zip(result[f"grads{step}"], result["expected_grads"], strict=True):
                torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
        assert torch.equal(result["alone"], expected)
        loss, written, per_rank = result["reduced"]
        assert loss == pytest.approx(1.5) and written
        assert per_rank == {"addr": [ADDRESS, ADDRESS + 1], "peak_mb": [100.0, 101.0]}
    assert torch.equal(ranks[0]["stats0"], ranks[1]["stats0"])  # every rank decides on the same numbers
    # fp32: two steps and the StepStats one rode the first bucket; bf16 buckets carried none
    assert [r["carried"] for r in ranks] == ([3, 3] if dtype == torch.float32 else [0, 0])


def test_split_halves_add_back_to_the_float64_value() -> None:
    values = torch.tensor([ADDRESS, 1 / 3, -2.5e-12, float("inf"), float("-inf"), 0.0], dtype=torch.float64)
    halves = split64(values, torch.float32)
    assert halves.dtype == torch.float32 and halves.numel() == 2 * values.numel()
    back = join64(halves)
    assert back[0].item() == ADDRESS and back[3].item() == float("inf") and back[4].item() == float("-inf")
    assert back[1].item() == pytest.approx(1 / 3, rel=1e-14)
    assert back[2].item() == pytest.approx(-2.5e-12, rel=1e-14)
