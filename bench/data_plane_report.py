"""BENCHMARKS.md's data-plane section, from bench/data_plane.py's saved results."""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.report import summarise

SECTION = "## Data plane: each rank reads its own share"


def _mb(value: float) -> str:
    return f"{value / 2**20:,.0f}"


def data_plane(saved: dict[str, Any]) -> list[str]:
    size = saved["dataset_bytes"]
    at = time.strftime("%Y-%m-%d %H:%M", time.gmtime(saved["began"]))
    lines = [
        "",
        SECTION,
        "",
        f"`.venv/bin/python bench/data_plane.py --base {saved['base']}`, from {at} UTC on "
        f"{saved['machine']}; CPU capability {saved['cpu']}. A read-bound workload the bench writes: "
        f"{saved['rows']:,} rows of 256 float32 features in row groups of 2,048 rows, {_mb(size)} MiB of "
        "parquet, a tiny MLP, global batch 2,048 in micro-batches of 512. *old*: shoal at "
        f"{saved['base']}, where every rank iterated the whole training set through Ray Data and kept "
        "its own micro-batches; *new*: shoal here, each rank reading its lanes of the epoch plan.",
        "",
        "Bytes of the training files read in one epoch, summed over every process of the run, as the "
        "kernel counted them (`strace -f`, the return values of read syscalls on the dataset's files):",
        "",
        "| workers | old (MiB) | old / dataset | new (MiB) | new / dataset | new, shoal's own count (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for workers in (1, 2, 4):
        old, new = saved[f"bytes_{workers}"]["old"][0], saved[f"bytes_{workers}"]["new"][0]
        lines.append(
            f"| {workers} | {_mb(old['traced'])} | {old['traced'] / size:.2f} | {_mb(new['traced'])} | "
            f"{new['traced'] / size:.3f} | {_mb(new.get('counted', 0))} |"
        )
    speed = saved["speed_4"]
    ratio = [n["samples_per_s"] / o["samples_per_s"] for o, n in zip(speed["old"], speed["new"], strict=True)]
    old_90, new_90 = saved["resume_90"]["old"][0], saved["resume_90"]["new"][0]
    new_10 = saved["resume_10"]["new"][0]
    lines += [
        "",
        f"At 4 workers, {len(ratio)} pairs (order rotated), medians of the steady steps (step 6 on):",
        "",
        "| figure | old | new | new / old |",
        "| --- | --- | --- | --- |",
        f"| samples/s | {summarise([o['samples_per_s'] for o in speed['old']])} | "
        f"{summarise([n['samples_per_s'] for n in speed['new']])} | {summarise(ratio)} |",
        f"| data-wait share of step time | {summarise([o['data_wait_share'] for o in speed['old']])} | "
        f"{summarise([n['data_wait_share'] for n in speed['new']])} | |",
        f"| first batch after a resume at 10 % of the epoch (s, 2 workers) | "
        f"{saved['resume_10']['old'][0]:.2f} | {new_10:.2f} | |",
        f"| first batch after a resume at 90 % of the epoch (s, 2 workers) | {old_90:.2f} | {new_90:.2f} | "
        f"{new_90 / old_90:.3f} |",
        "",
        f"New, resume at 90 % / at 10 %: {new_90 / new_10:.2f} (target <= 1.2). The data wait of the "
        "first resumed step is the time from asking for the first batch to having it. Median "
        f"new/old samples/s: {statistics.median(ratio):.2f}.",
    ]
    return lines


def val_parity(saved: dict[str, Any]) -> list[str]:
    """bench/val_parity.py's runs: the final validation numbers, old pipeline and new, per seed."""
    at = time.strftime("%Y-%m-%d %H:%M", time.gmtime(saved["began"]))
    lines = [
        "",
        "### Validation numbers, old pipeline and new",
        "",
        f"`.venv/bin/python bench/val_parity.py --base {saved['base']}`, from {at} UTC, CPU capability "
        f"{saved['cpu']}: each workload trained with the same seeds at {saved['base']} (old) and here "
        "(new); the final evaluation's numbers. Noise: the spread (max - min) over seeds within a pipeline.",
        "",
        "| workload | metric | old, per seed | new, per seed | new - old (medians) | noise (old, new) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for workload, pipelines in saved["runs"].items():
        for metric in pipelines["old"][0]:
            old = [run[metric] for run in pipelines["old"]]
            new = [run[metric] for run in pipelines.get("new", [])]
            if len(new) != len(old):
                continue
            shift = statistics.median(new) - statistics.median(old)
            lines.append(
                f"| {workload} | {metric} | {', '.join(f'{v:.4f}' for v in old)} | "
                f"{', '.join(f'{v:.4f}' for v in new)} | {shift:+.4f} | "
                f"{max(old) - min(old):.4f}, {max(new) - min(new):.4f} |"
            )
    return lines
