"""BENCHMARKS.md's telemetry section, from bench/telemetry.py's saved results."""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.report import summarise

SECTION = "## Telemetry as the world grows"
FLAT = 1.5  # beyond the threshold, at most this many times the 8-rank figure


def _figure(runs: list[dict[str, float]], key: str) -> list[float]:
    return [run[key] for run in runs]


def telemetry(saved: dict[str, Any]) -> list[str]:
    at = time.strftime("%Y-%m-%d %H:%M", time.gmtime(saved["began"]))
    runs = saved["runs"]
    lines = [
        "",
        SECTION,
        "",
        f"`.venv/bin/python bench/telemetry.py --repeats {saved['repeats']}`, from {at} UTC on "
        f"{saved['machine']}; CPU capability {saved['cpu']}. Synthetic worker reports made by the "
        "workers' own code (every rank's gathered values with one straggler, four GPU readings) drive "
        "the driver's real path: Ray Train's controller callback, the report queue, the Drainer, the "
        f"Recorder and MLflow on sqlite; {saved['steps']} steps, a report every "
        f"{saved['steps_per_report']}. *new*: `monitor.per_rank_up_to: 8` (the default: beyond 8 "
        "ranks, min / median / max / arg-max rank per value, and the stragglers' own series); *old*: "
        "every rank's own series. Pairs in each repetition, order alternated; medians (min-max).",
        "",
        "| ranks | MLflow rows / step, new | old | driver CPU ms / step, new | old | new / 8-rank CPU | "
        "controller KB / step, new | every rank sending the records |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base_cpu = statistics.median(_figure(runs["8"]["new"], "driver_cpu_ms_per_step"))
    base_rows = statistics.median(_figure(runs["8"]["new"], "rows_per_step"))
    flat = []
    for world, pair in sorted(runs.items(), key=lambda item: int(item[0])):
        new, old = pair["new"], pair["old"]
        cpu = _figure(new, "driver_cpu_ms_per_step")
        if int(world) > 8:
            flat.append(statistics.median(cpu) <= FLAT * base_cpu)
            flat.append(statistics.median(_figure(new, "rows_per_step")) <= FLAT * base_rows)
        lines.append(
            f"| {int(world):,} | {summarise(_figure(new, 'rows_per_step'))} | "
            f"{summarise(_figure(old, 'rows_per_step'))} | {summarise(cpu)} | "
            f"{summarise(_figure(old, 'driver_cpu_ms_per_step'))} | "
            f"{statistics.median(cpu) / base_cpu:.2f} | "
            f"{summarise(_figure(new, 'controller_kb_per_step'))} | "
            f"{summarise(_figure(new, 'controller_kb_per_step_if_every_rank_sent_records'))} |"
        )
    verdict = "flat" if all(flat) else "NOT flat"
    lines += [
        "",
        f"Beyond 8 ranks, rows and driver CPU per step are {verdict} (target <= {FLAT} x the 8-rank "
        "figure). The last column is what Ray Train's controller would take in per step if every rank "
        "still sent its copy of the step records (they are the same on every rank; only rank 0's are "
        "read): it grew with the world squared; now the other ranks send their summary alone.",
    ]
    return lines
