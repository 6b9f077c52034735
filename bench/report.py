"""BENCHMARKS.md from the results bench/run.py saved (bench/results.json)."""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from bench.cpu_share import others, trainer_cores

RECOVERY_SECTION = "## Checkpoints and recovery"  # written by bench/recovery.py, kept by bench/run.py
TARGET_STEADY, TARGET_FIRST_STEP, TARGET_DATA_WAIT = 0.95, 1.2, 0.02
SHOWN = {
    "torchrun": "`PYTHONPATH=. .venv/bin/torchrun --standalone --nproc-per-node 2 "
    "bench/torchrun_ddp.py --precision P`",
    "ray": "`PYTHONPATH=. .venv/bin/python bench/ray_train_bare.py --precision P`",
    "shoal": "`.venv/bin/shoal run bench/gpt_bench.yaml --set train.precision=P`",
    "shoal-for-loop": "`.venv/bin/shoal run bench/gpt_bench.yaml --set train.precision=P "
    "--set train.optimizer.implementation=for-loop`",
    "shoal-1-worker": "`.venv/bin/shoal run bench/gpt_bench.yaml --set scaling.workers=1`",
    "shoal-3-nodes": "`.venv/bin/python bench/multinode.py --precision fp32`",
    "data": "`PYTHONPATH=. .venv/bin/python bench/data_pipeline.py`",
}
FP32_SHOAL = SHOWN["shoal"].replace("=P`", "=fp32`")


def fmt(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def summarise(values: list[float]) -> str:
    """Median (min-max)."""
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def verdict(values: list[float], target: float, at_least: bool) -> str:
    middle = statistics.median(values)
    met = middle >= target if at_least else middle <= target
    return f"{summarise(values)} {'meets' if met else 'short of'} {'>=' if at_least else '<='} {target}"


def machine() -> str:
    import mlflow
    import ray
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB, {gpu}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, Ray {ray.__version__}, MLflow {mlflow.__version__}"
    )


def cpu() -> str:
    """The CPU as torch dispatches for it, and whether it runs bf16 natively (shoal/hardware.py):
    'AVX512 with AVX512-BF16, bf16 native' or 'AVX2 without AVX512-BF16 or AMX, bf16 emulated'.
    An emulated bf16 is ~20x slower than fp32, so a bf16 figure means nothing without it."""
    from shoal.hardware import this_cpu

    found = this_cpu()
    return f"{found.describe().removeprefix('CPU ')}, bf16 {'native' if found.bf16 else 'emulated'}"


def cpu_line(results: dict[str, Any]) -> str:
    """The CPU capability a `make bench` run saved; runs from before it was saved say so, with
    what their own bf16 figures show."""
    if results.get("cpu"):
        return f"CPU capability {results['cpu']}"
    speed = {
        precision: statistics.median(r["tokens_per_s"] for r in results["runs"][precision]["shoal"])
        for precision in ("fp32", "bf16")
    }
    faster = speed["bf16"] / speed["fp32"]
    return (
        f"CPU capability not recorded by this run (bf16 ran {faster:.1f}x as fast as fp32 in it, "
        "which only a CPU with native bf16 does)"
    )


def render(results: dict[str, Any]) -> str:
    began, ended = (time.strftime("%Y-%m-%d %H:%M", time.gmtime(results[k])) for k in ("began", "ended"))
    minutes = (results["ended"] - results["began"]) / 60
    lines = [
        "# Benchmarks",
        "",
        f"Machine: {results['machine']}; {cpu_line(results)}.",
        f"Measured by `make bench` from {began} to {ended} UTC ({minutes:.1f} min); raw results in "
        "bench/results.json (`python bench/run.py --render-only` rewrites this file from them).",
        "",
        "The ~10.8M-parameter byte GPT (6 layers, d_model 384, seq 256) on pytext, 2 workers, micro-batch 4, "
        f"{results['steps']} steps, {results['repeats']} repetitions (contender order rotated); steady state "
        "= median step after 5 warm-up steps; time to first step = from launching the command to the end of "
        "step 1. Cells: median (min-max) over the repetitions. P is fp32 or bf16.",
        "",
        *three_way(results["runs"]),
        *cores(results["runs"]),
        *data_pipeline(results["runs"]["fp32"]),
        *scaling(results["runs"]["fp32"]),
    ]
    return "\n".join(lines) + "\n"


def commit_ab(saved: dict[str, Any]) -> list[str]:
    """bench/compare_commits.py's paired runs: shoal at two commits, each against torchrun."""
    speed = saved["tokens_per_s"]
    pairs = list(zip(speed["torchrun"], speed["base"], speed["here"], strict=True))
    at = time.strftime("%Y-%m-%d %H:%M", time.gmtime(saved["began"]))
    command = (
        f"`.venv/bin/python bench/compare_commits.py {saved['base']} --repeats {len(pairs)} "
        f"--steps {saved['steps']}`"
    )
    base_ratio, here_ratio = [b / t for t, b, _ in pairs], [h / t for t, _, h in pairs]
    return [
        "",
        f"## shoal at {saved['here']} against {saved['base']}",
        "",
        f"{command}, from {at} UTC on {saved['machine']}: {saved['precision']}, {len(pairs)} repetitions "
        f"of torchrun, shoal at {saved['base']} and shoal at {saved['here']} back to back (order rotated), "
        "the same model and commands as above; ratios taken within each repetition.",
        "",
        "| | tokens/s | shoal/torchrun |",
        "| --- | --- | --- |",
        f"| torchrun | {summarise(speed['torchrun'])} | |",
        f"| shoal at {saved['base']} | {summarise(speed['base'])} | {summarise(base_ratio)} |",
        f"| shoal at {saved['here']} | {summarise(speed['here'])} | {summarise(here_ratio)} |",
        "",
        f"Per repetition, {saved['here']}/{saved['base']}: "
        + ", ".join(f"{h / b:.3f}" for _, b, h in pairs)
        + f" (median {statistics.median(h / b for _, b, h in pairs):.3f}).",
    ]


def to_torchrun(run: dict[str, Any], torchrun: dict[str, Any]) -> float:
    """A contender's steady tokens/s over torchrun's: over the geometric mean of the torchrun
    runs just before and after it (bench/run.py's bracket), or, in results from before the
    bracket, over its repetition's one torchrun run."""
    around = run.get("torchrun_around")
    reference = math.sqrt(around[0] * around[1]) if around else torchrun["tokens_per_s"]
    return run["tokens_per_s"] / reference


def three_way(runs: dict[str, dict[str, list[dict]]]) -> list[str]:
    lines = [
        "## shoal vs torchrun vs bare Ray Train",
        "",
        "| precision | contender | tokens/s | time to first step (s) | command |",
        "| --- | --- | --- | --- | --- |",
    ]
    kernel_ab = all("shoal-for-loop" in runs[p] for p in ("fp32", "bf16"))  # since 42ea340
    contenders = ("torchrun", "ray", "shoal", *(["shoal-for-loop"] if kernel_ab else []))
    for precision in ("fp32", "bf16"):
        for name in contenders:
            done = runs[precision][name]
            lines.append(
                f"| {precision} | {name} | {summarise([r['tokens_per_s'] for r in done])} | "
                f"{summarise([r['first_step_s'] for r in done])} | {SHOWN[name]} |"
            )
    lines += [
        "",
        "Ratios, pair by pair within each repetition"
        + (
            ": each contender ran between two torchrun runs, and its steady tokens/s is divided by "
            "their geometric mean (the host's speed drifted between runs minutes apart; the bracket "
            "cancels a steady drift); shoal/bare Ray is the ratio of the two contenders' ratios to "
            "their brackets:"
            if "torchrun_around" in runs["fp32"]["shoal"][0]
            else ":"
        ),
        "",
        f"| precision | steady tokens/s shoal/torchrun (target >= {TARGET_STEADY}) | steady tokens/s "
        f"shoal/bare Ray | first step shoal/bare Ray (target <= {TARGET_FIRST_STEP}) |"
        + (" shoal-for-loop/torchrun |" if kernel_ab else ""),
        "| --- | --- | --- | --- |" + (" --- |" if kernel_ab else ""),
    ]
    for precision in ("fp32", "bf16"):
        by = runs[precision]
        pairs = list(zip(by["shoal"], by["torchrun"], by["ray"], strict=True))
        steady = [to_torchrun(s, t) for s, t, _ in pairs]
        steady_ray = [to_torchrun(s, t) / to_torchrun(r, t) for s, t, r in pairs]
        first = [s["first_step_s"] / r["first_step_s"] for s, _, r in pairs]
        kernel_cell = ""
        if kernel_ab:
            same = [to_torchrun(s, t) for s, t in zip(by["shoal-for-loop"], by["torchrun"], strict=True)]
            kernel_cell = f" {summarise(same)} |"
        lines.append(
            f"| {precision} | {verdict(steady, TARGET_STEADY, True)} | {summarise(steady_ray)} | "
            f"{verdict(first, TARGET_FIRST_STEP, False)} |{kernel_cell}"
        )
    if kernel_ab:
        lines += [
            "",
            "shoal runs torch's fused AdamW kernel by default (`train.optimizer.implementation: auto`); the "
            "torchrun and Ray Train scripts, as most hand-written ones, run torch's default, a for-loop on "
            "CPU. *shoal-for-loop* is shoal set to that same kernel, in the same rotation: its ratio to "
            "torchrun is shoal's own cost, the kernel aside.",
        ]
    return [*lines, ""]


def cores(runs: dict[str, dict[str, list[dict]]]) -> list[str]:
    """Who used the 2 cores during the steady-state window (bench/cpu_share.py)."""
    lines = [
        "## Where the cores went (steady state)",
        "",
        "CPU used during each run's steady-state window, in cores (2 = the whole machine), sampled from "
        "/proc every second. With two ranks on two cores, every other process takes time from a rank, and "
        "the other rank waits for it at the next all-reduce.",
        "",
        "| precision | contender | trainers | everything else | largest others (mean over runs) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for precision in ("fp32", "bf16"):
        for name in ("torchrun", "ray", "shoal"):
            shares = [r["cpu"] for r in runs[precision][name] if r.get("cpu")]
            if not shares:
                continue
            rest: dict[str, float] = {}
            for share in shares:
                for key, used in others(share, top=len(share)):
                    rest[key] = rest.get(key, 0.0) + used / len(shares)
            largest = ", ".join(f"{k} {v:.3f}" for k, v in sorted(rest.items(), key=lambda kv: -kv[1])[:6])
            lines.append(
                f"| {precision} | {name} | {summarise([trainer_cores(s) for s in shares])} | "
                f"{summarise([sum(s.values()) - trainer_cores(s) for s in shares])} | {largest} |"
            )
    return [*lines, ""]


def data_pipeline(fp32: dict[str, list[dict]]) -> list[str]:
    consumed = [r["tokens_per_s"] / 256 / 2 for r in fp32["shoal"]]  # rows/s each worker trains on
    produced = [r["rows_per_s"] for r in fp32["data"]]
    wait = [100 * r["data_wait_share"] for r in fp32["shoal"]]
    headroom = [p / c for p, c in zip(produced, consumed, strict=True)]
    return [
        "## Data pipeline",
        "",
        "Ray Data read -> preprocess (int64 cast) -> iter_torch_batches on one consumer, against what one "
        "shoal worker trains on (fp32, 2 workers):",
        "",
        "| figure | median (min-max) | command |",
        "| --- | --- | --- |",
        f"| pipeline rows/s, one consumer | {summarise(produced)} | {SHOWN['data']} |",
        f"| rows/s trained on per worker | {summarise(consumed)} | {FP32_SHOAL} |",
        f"| headroom (pipeline / consumption) | {summarise(headroom)} | both |",
        f"| data-wait share of step time, shoal fp32 (%; target < {100 * TARGET_DATA_WAIT:.0f}) | "
        f"{summarise(wait)} | {FP32_SHOAL} |",
        "",
    ]


def scaling(fp32: dict[str, list[dict]]) -> list[str]:
    one, two, nodes = fp32["shoal-1-worker"], fp32["shoal"], fp32["shoal-3-nodes"]
    speed = [n["tokens_per_s"] / s["tokens_per_s"] for n, s in zip(nodes, two, strict=True)]
    first = [n["first_step_s"] / s["first_step_s"] for n, s in zip(nodes, two, strict=True)]
    return [
        "## Scaling",
        "",
        "| setting (fp32) | tokens/s | time to first step (s) | command |",
        "| --- | --- | --- | --- |",
        f"| 1 worker, 1 node | {summarise([r['tokens_per_s'] for r in one])} | "
        f"{summarise([r['first_step_s'] for r in one])} | {SHOWN['shoal-1-worker']} |",
        f"| 2 workers, 1 node | {summarise([r['tokens_per_s'] for r in two])} | "
        f"{summarise([r['first_step_s'] for r in two])} | {FP32_SHOAL} |",
        f"| 2 workers, 3 simulated nodes | {summarise([r['tokens_per_s'] for r in nodes])} | "
        f"{summarise([r['first_step_s'] for r in nodes])} | {SHOWN['shoal-3-nodes']} |",
        "",
        "Control-plane overhead of going multi-node, pair by pair within each fp32 repetition: "
        f"tokens/s 3 nodes / 1 node {summarise(speed)}; "
        f"time to first step 3 nodes / 1 node {summarise(first)}. "
        "The three nodes (`ray.cluster_utils.Cluster`, bench/multinode.py) are a head with no CPUs and two "
        "1-CPU nodes, one training worker each, all on this machine: the same work, with three raylets, "
        "cross-node object transfers and remote actor calls; the cluster is up before the clock starts. "
        "On 2 cores both settings use both cores: 1 worker through 2 torch threads, 2 workers "
        "through 1 thread each plus DDP's all-reduce.",
        "",
        gpu_line(),
        "",
    ]


def gpu_line() -> str:
    return (
        "GPU: no GPU was lent to the session that measured this (the device tool reported `not_drawn`), "
        "so there is no GPU row (tokens/s and MFU at the largest GPT that fits)."
    )
