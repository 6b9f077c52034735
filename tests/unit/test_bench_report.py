"""bench/: the CPU-share arithmetic and the verdicts BENCHMARKS.md prints (no runs)."""

from __future__ import annotations

from bench.cpu_share import TICKS_PER_S, CpuSampler, others, trainer_cores
from bench.report import render, verdict


def test_shares_count_each_process_over_the_window_only():
    sampler = CpuSampler()
    sampler.taken = [
        (0.0, {1: (0, "ray::RayTrainWorker", 1), 2: (0, "gcs_server", 1)}),
        (10.0, {1: (5 * TICKS_PER_S, "ray::RayTrainWorker", 1), 2: (1 * TICKS_PER_S, "gcs_server", 1)}),
        (
            20.0,
            {
                1: (14 * TICKS_PER_S, "ray::RayTrainWorker", 1),
                2: (2 * TICKS_PER_S, "gcs_server", 1),
                3: (3 * TICKS_PER_S, "ray::IDLE", 1),
            },
        ),
        (30.0, {1: (30 * TICKS_PER_S, "ray::RayTrainWorker", 1)}),
    ]
    shares = sampler.shares(5.0, 25.0)  # the snapshots at 10 s and 20 s
    assert shares == {"ray::RayTrainWorker": 0.9, "gcs_server": 0.1, "ray::IDLE": 0.3}
    assert trainer_cores(shares) == 0.9
    assert others(shares) == [("ray::IDLE", 0.3), ("gcs_server", 0.1)]
    assert sampler.shares(5.0, 12.0) == {}  # one snapshot: no window


def test_a_reused_pid_starts_from_zero():
    sampler = CpuSampler()
    sampler.taken = [
        (0.0, {7: (50 * TICKS_PER_S, "ray::IDLE", 1)}),
        (10.0, {7: (2 * TICKS_PER_S, "torchrun_ddp.py", 900)}),
    ]
    assert sampler.shares(0.0, 10.0) == {"torchrun_ddp.py": 0.2}


def test_verdicts_name_the_target():
    assert verdict([0.9, 0.96, 0.97], 0.95, at_least=True) == "0.96 (0.9-0.97) meets >= 0.95"
    assert verdict([1.3, 1.25, 1.0], 1.2, at_least=False) == "1.25 (1-1.3) short of <= 1.2"


def run(tokens: float, first: float, **extra: float) -> dict:
    cpu = {"ray::RayTrainWorker": 1.8, "gcs_server": 0.05}
    return {"tokens_per_s": tokens, "first_step_s": first, "cpu": cpu, **extra}


def test_render_writes_every_section_with_paired_ratios():
    by_name = {
        "torchrun": [run(2000, 5), run(2100, 5), run(1900, 5)],
        "ray": [run(1800, 20), run(1900, 20), run(1700, 20)],
        "shoal": [run(1800, 22, data_wait_share=0.001)] * 3,
        "shoal-3-nodes": [run(1700, 21)] * 3,
        "shoal-1-worker": [run(1500, 19)] * 3,
        "data": [{"rows_per_s": 3000.0}] * 3,
    }
    results = {"machine": "m", "steps": 20, "repeats": 3, "began": 0.0, "ended": 960.0}
    text = render({**results, "runs": {"fp32": by_name, "bf16": by_name}})
    for heading in ("## shoal vs torchrun", "## Where the cores went", "## Data pipeline", "## Scaling"):
        assert heading in text
    assert (
        "| fp32 | 0.9 (0.857-0.947) short of >= 0.95 | 1 (0.947-1.06) | 1.1 (1.1-1.1) meets <= 1.2 |" in text
    )
    assert "tokens/s 3 nodes / 1 node 0.944 (0.944-0.944)" in text
    assert "(16.0 min)" in text
