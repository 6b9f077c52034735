"""BENCHMARKS.md's control-plane, cluster-settings and idle-Ray-process sections, from
bench/control_plane.py's, bench/levers.py's and bench/ray_idle.py's saved results."""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.report import summarise, verdict

CONTROL_SECTION = "## Control plane as workers grow"
LEVERS_SECTION = "## Cluster settings for steady state"
IDLE_SECTION = "## What one idle Ray process costs"
STEADY_TARGET, FIRST_STEP_TARGET = 1.05, 1.2


def _steps(steps: int | dict[str, int]) -> str:
    """The step count as a phrase: 300 steps, or 2000 / 800 / 400 steps at 2 / 4 / 8 workers."""
    if isinstance(steps, int):
        return f"{steps} steps"
    return f"{' / '.join(map(str, steps.values()))} steps at {' / '.join(steps)} workers"


def _when(saved: dict[str, Any]) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(saved["began"]))


def control_plane(saved: dict[str, Any]) -> list[str]:
    lines = [
        "",
        CONTROL_SECTION,
        "",
        f"`.venv/bin/python bench/control_plane.py --repeats {saved['repeats']}`, from {_when(saved)} UTC "
        f"on {saved['machine']}; CPU capability {saved['cpu']}. A tiny GPT ({saved['model']}, 4 sequences "
        f"per worker per step, {_steps(saved['steps'])}) on a simulated multi-node cluster: a head "
        "with no CPUs and two worker nodes sharing the workers. The bare Ray Train script "
        "(bench/ray_train_bare.py: Ray Data, prepare_model, one report at the end) and `shoal run` (and "
        "*shoal-for-loop*, below) on the same cluster, order rotated, ratios paired per repetition; "
        "medians (min-max). Steady step: "
        "the median interval between step ends after 5 warm-up steps, as rank 0 clocks it (shoal: its "
        "`time/step_s`; MLflow's millisecond timestamps are too coarse for it); first step: from "
        "launching the "
        "process to the end of step 1. shoal's report path: the seconds per step its workers spent in "
        "Ray Train's report (`time/report_s`; a report every 2 s), beside the per-step all-reduce of "
        "its stats, which is inside the step time compared (it rides DDP's gradient all-reduce: "
        "worker/parallel/stats_ride.py). On 2 cores every process shares the CPUs. A /proc sampler "
        "(bench/cpu_share.py's method) around two pairs at 8 workers and 1,500 steps: shoal's workers "
        "took 153-169 CPU-s against bare's 142-149 (bare's reading runs in Ray Data's tasks, ~25 "
        "CPU-s more), shoal's driver 13.8-14.6 CPU-s against 4.1-4.4: 7.9-9.8 of them for the start "
        "and end (a 20-step run's driver took that), the rest MLflow's writes of every step's "
        "metrics: 27 rows a step at 8 workers, ~0.1 ms "
        "of CPU each in MLflow's sqlite store (38 before stall times and link round trips became "
        "points only at the steps they happened). With the driver writing two series instead of all, "
        "a paired A/B at 8 workers ran 1.23, 1.04 and 1.11 x faster; lowering the writer thread's "
        "priority changed no step time.",
        "",
        "| workers | steady step s, bare | shoal | shoal / bare | first step s, bare | shoal | "
        "shoal / bare | shoal's report s / step | reports |"
        + (" shoal-for-loop step s | its / bare |" if _kernel_ab(saved) else ""),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        + (" --- | --- |" if _kernel_ab(saved) else ""),
    ]
    for workers, pairs in saved["runs"].items():
        bare, shoal = [p["bare"] for p in pairs], [p["shoal"] for p in pairs]
        steady = [s["step_s"] / b["step_s"] for s, b in zip(shoal, bare, strict=True)]
        first = [s["first_step_s"] / b["first_step_s"] for s, b in zip(shoal, bare, strict=True)]
        cells = [
            workers,
            _of(bare, "step_s"),
            _of(shoal, "step_s"),
            verdict(steady, STEADY_TARGET, False),
            _of(bare, "first_step_s"),
            _of(shoal, "first_step_s"),
            verdict(first, FIRST_STEP_TARGET, False),
            _of(shoal, "report_s_per_step"),
            _of(shoal, "reports"),
        ]
        if _kernel_ab(saved):
            same = [p["shoal-for-loop"] for p in pairs]
            cells += [
                _of(same, "step_s"),
                summarise([s["step_s"] / b["step_s"] for s, b in zip(same, bare, strict=True)]),
            ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if _kernel_ab(saved):
        lines += [
            "",
            "shoal runs torch's fused AdamW by default (`train.optimizer.implementation: auto`), the bare "
            "script torch's default (a for-loop on CPU: ~0.3 ms more a step on this model). "
            "*shoal-for-loop* is shoal with that same kernel, in the same rotation: its ratio is shoal's "
            "control plane and bookkeeping alone.",
        ]
    return lines


def _kernel_ab(saved: dict[str, Any]) -> bool:
    """Whether the runs hold shoal with the bare script's optimizer kernel (since 90760f6)."""
    return all("shoal-for-loop" in pair for pairs in saved["runs"].values() for pair in pairs)


def _of(runs: list[dict[str, float]], key: str) -> str:
    return summarise([run[key] for run in runs])


def levers(saved: dict[str, Any]) -> list[str]:
    runs = saved["runs"]
    names = [n for n in runs[0] if n != "torchrun"]
    lines = [
        "",
        LEVERS_SECTION,
        "",
        f"`.venv/bin/python bench/levers.py --repeats {saved['repeats']}`, from {_when(saved)} UTC on "
        f"{saved['machine']}; CPU capability {saved['cpu']}. `shoal run --address` of `make bench`'s "
        f"run (fp32, 2 workers, {saved['steps']} steps) on a one-node cluster of 4 logical CPUs started "
        "with Ray's defaults, and with each setting alone; torchrun once per repetition. Medians "
        "(min-max) of shoal's steady tokens/s over torchrun's in the same repetition, and of each "
        "setting's gain over the defaults' run of the same repetition. A setting *helps* when every "
        "repetition gained.",
        "",
        "| cluster setting | shoal / torchrun | gain over Ray's defaults (paired) | verdict |",
        "| --- | --- | --- | --- |",
        f"| torchrun (tokens/s) | {summarise([r['torchrun'] for r in runs])} | | |",
    ]
    for name in names:
        ratio = [r[name] / r["torchrun"] for r in runs]
        gain = [r[name] / r["defaults"] for r in runs]
        helps = "" if name == "defaults" else ("helps" if min(gain) > 1.0 else "no clear gain")
        shown = "" if name == "defaults" else summarise(gain)
        lines.append(f"| {SETTINGS.get(name, name)} | {summarise(ratio)} | {shown} | {helps} |")
    best = max(names, key=lambda n: statistics.median(r[n] / r["torchrun"] for r in runs))
    lines += ["", f"Highest median ratio: {SETTINGS.get(best, best)}."]
    return lines


SETTINGS = {
    "defaults": "Ray's defaults (dashboard, metrics, log monitor, prestarted workers)",
    "metrics": "`RAY_enable_metrics_collection=false`",
    "log_monitor": "`--include-log-monitor=false`",
    "prestart": "`RAY_enable_worker_prestart=false`, `RAY_prestart_worker_first_driver=false`",
    "dashboard": "`--include-dashboard=false`",
    "lean": "all four at once",
}


def ray_idle(saved: dict[str, Any]) -> list[str]:
    runs = saved["runs"]
    return [
        "",
        IDLE_SECTION,
        "",
        f"`.venv/bin/python bench/ray_idle.py --repeats {saved['repeats']}`, from {_when(saved)} UTC on "
        f"{saved['machine']}; CPU capability {saved['cpu']}. {saved['actors']} actors that do nothing on "
        f"a local Ray started as `shoal run` starts one, measured over {saved['window_s']:g} s per "
        "repetition from /proc; medians (min-max) of the per-actor means. Every Ray worker process "
        "runs Ray's task-execution loop, whose main thread wakes every 10 ms to check for signals and "
        "takes the GIL to do it (CoreWorker::RunTaskExecutionLoop; the period is compiled into Ray, "
        "not a setting). A `shoal run` has seven such processes beside its trainers (Ray Train's "
        "controller, placement-group cleaner and synchronization actor, its dataset manager, Ray "
        "Data's autoscaling coordinator, a prestarted idle worker and shoal's report queue: the "
        "table of where the cores went), and each trainer has that thread too, waking beside the "
        "training thread, which Ray Train runs apart from the main one. torchrun's ranks have "
        "neither: this is the floor under shoal's and bare Ray Train's gap to torchrun on 2 cores "
        "that no cluster setting above removes.",
        "",
        "| main thread's wake-ups / s | main thread, cores | whole process, cores |",
        "| --- | --- | --- |",
        f"| {_of(runs, 'wakeups_per_s')} | {_of(runs, 'main_thread_cores')} | {_of(runs, 'process_cores')} |",
    ]
