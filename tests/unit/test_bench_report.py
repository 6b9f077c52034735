"""bench/: the CPU-share arithmetic and the verdicts BENCHMARKS.md prints (no runs)."""

from __future__ import annotations

from bench.cpu_share import TICKS_PER_S, CpuSampler, others, trainer_cores
from bench.report import render, to_torchrun, verdict


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
    assert "shoal-for-loop" not in text  # results from before the kernel A/B render as they were


def test_the_kernel_ab_gets_its_own_row_and_ratio_to_torchrun():
    by_name = {
        "torchrun": [run(2000, 5), run(2100, 5), run(1900, 5)],
        "ray": [run(1800, 20)] * 3,
        "shoal": [run(2000, 22, data_wait_share=0.001)] * 3,
        "shoal-for-loop": [run(1800, 22), run(1890, 22), run(1805, 22)],
        "shoal-3-nodes": [run(1700, 21)] * 3,
        "shoal-1-worker": [run(1500, 19)] * 3,
        "data": [{"rows_per_s": 3000.0}] * 3,
    }
    results = {"machine": "m", "steps": 20, "repeats": 3, "began": 0.0, "ended": 960.0}
    text = render({**results, "runs": {"fp32": by_name, "bf16": by_name}})
    assert "| fp32 | shoal-for-loop | 1,805 (1,800-1,890) |" in text
    ratios = "| fp32 | 1 (0.952-1.05) meets >= 0.95 | 1.11 (1.11-1.11) | 1.1 (1.1-1.1) meets <= 1.2 |"
    assert ratios + " 0.9 (0.9-0.95) |" in text


def test_a_bracketed_contender_is_compared_with_the_torchrun_runs_around_it():
    """The host slowed between the repetition's first torchrun (2,000) and shoal's run: shoal
    is held against the geometric mean of the runs before and after it (1,000 and 4,000)."""
    bracketed = {**run(1800, 22, data_wait_share=0.001), "torchrun_around": [1000.0, 4000.0]}
    by_name = {
        "torchrun": [run(2000, 5)] * 3,
        "ray": [{**run(1000, 20), "torchrun_around": [1000.0, 1000.0]}] * 3,
        "shoal": [bracketed] * 3,
        "shoal-for-loop": [{**run(1900, 22), "torchrun_around": [2000.0, 2000.0]}] * 3,
        "shoal-3-nodes": [run(1700, 21)] * 3,
        "shoal-1-worker": [run(1500, 19)] * 3,
        "data": [{"rows_per_s": 3000.0}] * 3,
    }
    assert to_torchrun(bracketed, run(2000, 5)) == 0.9
    assert to_torchrun(run(1800, 22), run(2000, 5)) == 0.9  # no bracket: the repetition's torchrun
    results = {"machine": "m", "steps": 20, "repeats": 3, "began": 0.0, "ended": 960.0}
    text = render({**results, "runs": {"fp32": by_name, "bf16": by_name}})
    ratios = "| fp32 | 0.9 (0.9-0.9) short of >= 0.95 | 0.9 (0.9-0.9) | 1.1 (1.1-1.1) meets <= 1.2 |"
    assert ratios + " 0.95 (0.95-0.95) |" in text
    assert "each contender ran between two torchrun runs" in text


def test_control_plane_rows_pair_shoal_with_bare_ray_train_per_repetition():
    from bench.scale_report import control_plane

    def pair(bare_step: float, shoal_step: float) -> dict:
        bare = {"step_s": bare_step, "first_step_s": 10.0}
        shoal = {"step_s": shoal_step, "first_step_s": 11.0, "report_s_per_step": 0.002, "reports": 4}
        return {"bare": bare, "shoal": shoal}

    saved = {
        "repeats": 3, "began": 0.0, "machine": "m", "cpu": "AVX2", "steps": 40, "model": {"n_layers": 1},
        "runs": {"2": [pair(0.1, 0.102), pair(0.2, 0.2), pair(0.1, 0.11)]},
    }  # fmt: skip
    (row,) = [line for line in control_plane(saved) if line.startswith("| 2 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # paired: 1.02, 1.0 and 1.1 (unpaired medians would give 0.102 / 0.1)
    assert cells[3] == "1.02 (1-1.1) meets <= 1.05"
    assert cells[6] == "1.1 (1.1-1.1) meets <= 1.2"
    assert cells[7:] == ["0.002 (0.002-0.002)", "4 (4-4)"]
    for p, step in zip(saved["runs"]["2"], (0.105, 0.22, 0.1), strict=True):
        p["shoal-for-loop"] = {**p["shoal"], "step_s": step}
    (row,) = [line for line in control_plane(saved) if line.startswith("| 2 |")]
    assert [c.strip() for c in row.strip("|").split("|")][9:] == ["0.105 (0.1-0.22)", "1.05 (1-1.1)"]


def test_a_cluster_setting_helps_only_when_every_repetition_gained():
    from bench.scale_report import levers

    runs = [
        {"torchrun": 100.0, "defaults": 90.0, "metrics": 92.0, "dashboard": 95.0},
        {"torchrun": 100.0, "defaults": 91.0, "metrics": 93.0, "dashboard": 88.0},
    ]
    saved = {"repeats": 2, "began": 0.0, "machine": "m", "cpu": "AVX2", "steps": 20, "runs": runs}
    text = "\n".join(levers(saved))
    assert "| `RAY_enable_metrics_collection=false` | 0.925 (0.92-0.93) | 1.02 (1.02-1.02) | helps |" in text
    assert "| `--include-dashboard=false` | 0.915 (0.88-0.95) | 1.01 (0.967-1.06) | no clear gain |" in text


def test_the_idle_ray_process_row_is_the_median_of_the_repetitions():
    from bench.scale_report import ray_idle

    runs = [
        {"wakeups_per_s": 99.0, "main_thread_cores": 0.006, "process_cores": 0.009},
        {"wakeups_per_s": 101.0, "main_thread_cores": 0.004, "process_cores": 0.007},
        {"wakeups_per_s": 100.0, "main_thread_cores": 0.005, "process_cores": 0.008},
    ]
    saved = {"repeats": 3, "began": 0.0, "machine": "m", "cpu": "AVX2", "actors": 3, "window_s": 20.0}
    saved["runs"] = runs
    lines = ray_idle(saved)
    assert "`.venv/bin/python bench/ray_idle.py --repeats 3`" in lines[3]
    assert "CPU capability AVX2" in lines[3]
    assert lines[-1] == "| 100 (99-101) | 0.005 (0.004-0.006) | 0.008 (0.007-0.009) |"
