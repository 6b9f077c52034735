"""Telemetry as the world grows: MLflow rows per step and the driver's CPU per step at 2 to
1,024 ranks, with no Ray workers.

A generator makes every rank's `ray.train.report` metrics as the workers make them: the
step's gathered per-rank values (busy time with one straggler, the link's round trip, peak
memory, four GPU readings) through the worker's own `RankWatch` and `StepRecord`s, each
rank's `Reporter` payload. The timed part is the driver's path, the real code: Ray Train's
controller callback (`ForwardingCallback.after_report`, every rank's metrics in) onto a
queue, the `Drainer` thread, the `Recorder` and MLflow (a sqlite store). Paired in each
repetition: `per_rank_up_to` 8 (shoal's default) against every rank's own series (as
before). Rows are counted in the store.

    .venv/bin/python bench/telemetry.py --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import queue
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import cpu, machine  # noqa: E402
from shoal.messages import GpuReading, Metric, ReportSummary, StepRecord, WorkerValue  # noqa: E402
from shoal.spec.schema import MonitorSpec  # noqa: E402
from shoal.tracking import Recorder, open_run  # noqa: E402
from shoal.tracking.bridge import ForwardingCallback  # noqa: E402
from shoal.tracking.drain import Drainer  # noqa: E402
from shoal.worker.links import LINK_ADDRESS, address_number  # noqa: E402
from shoal.worker.metrics import RankWatch  # noqa: E402
from shoal.worker.reporting import Reporter, StepStats  # noqa: E402

WORLDS = (2, 8, 64, 512, 1024)
STEPS, STEPS_PER_REPORT = 20, 10
EVERY_RANK = 1_000_000  # `per_rank_up_to` that keeps every rank's own series: shoal before
RESULTS = REPO / "bench" / "results_telemetry.json"
# The scalar metrics of a step besides the per-rank ones (loop.py's record)
SCALARS = [m for m in Metric if m.value.startswith(("train/", "time/", "perf/"))]


class ListQueue(queue.Queue):
    """`ray.util.queue.Queue`'s calls that the controller callback and the Drainer make."""

    def size(self) -> int:
        return self.qsize()

    def get_nowait_batch(self, num_items: int) -> list[Any]:
        return [self.get_nowait() for _ in range(num_items)]


def gathered(world: int, step: int, rng: random.Random) -> dict[str, list[float]]:
    """What one step's all-reduce gives every rank: rank world-1 straggles."""
    busy = [0.05 + 0.005 * rng.random() for _ in range(world)]
    busy[-1] = 0.2
    values = {
        WorkerValue.BUSY_S: busy,
        WorkerValue.LINK_RTT_S: [0.0002 + 0.0001 * rng.random() for _ in range(world)],
        LINK_ADDRESS: [address_number(f"10.0.{r // 250}.{r % 250 + 1}") for r in range(world)],
        "peak_mb": [30_000.0 + rng.random() for _ in range(world)],
    }
    values.update({reading: [100 * rng.random() for _ in range(world)] for reading in GpuReading})
    return values


class Context:
    """A rank's `TrainContext.report` that keeps the metrics it would hand to Ray Train."""

    def __init__(self) -> None:
        self.metrics: dict[str, Any] = {}

    def report(self, metrics: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        self.metrics = metrics


def worker_reports(world: int, up_to: int) -> list[list[dict[str, Any]]]:
    """Every report's per-rank metrics, as the controller gets them (rank 0 first)."""
    rng, watch = random.Random(world), RankWatch(MonitorSpec(per_rank_up_to=up_to))
    reporters = [Reporter(StepStats(world, 1e9, rank), Context()) for rank in range(world)]
    reports = []
    for step in range(1, STEPS + 1):
        values = gathered(world, step, rng)
        events = watch.observe(step, values)  # the same on every rank
        record = StepRecord(
            step, time.time(), {**{m: rng.random() for m in SCALARS}, **watch.step_metrics(values, gpus=True)}
        )
        for reporter in reporters:  # each rank holds its own copy (shared here: it is not changed)
            reporter.record_step(record)
            for event in events:
                fields = dict(event)
                reporter.event(fields.pop("kind"), **fields)
        if step % STEPS_PER_REPORT == 0:
            for reporter in reporters:
                reporter.send(ReportSummary(step, 0, step * world, world, STEPS))
            reports.append([reporter.context.metrics for reporter in reporters])  # type: ignore[attr-defined]
    return reports


def drive(reports: list[list[dict[str, Any]]], store: Path, name: str) -> dict[str, float]:
    """The driver's path from the controller's callback to MLflow; its CPU and the rows."""
    uri = f"sqlite:///{store}"
    run = open_run(uri, "telemetry", name, str(store.parent / name), False, {}, "", {})
    reports_queue, recorder = ListQueue(), Recorder(run)
    callback, drainer = ForwardingCallback(reports_queue), Drainer(reports_queue, recorder)
    drainer.start()
    gc.collect()  # the previous run's garbage is not this run's cost
    cpu, wall = time.process_time(), time.perf_counter()
    for per_rank in reports:
        callback.after_report(None, per_rank, None)
    drainer.finish()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    recorder.finish("FINISHED")
    with sqlite3.connect(store) as db:
        (rows,) = db.execute("SELECT COUNT(*) FROM metrics WHERE run_uuid = ?", (run.run_id,)).fetchone()
    lead = sum(len(json.dumps(per_rank[0])) for per_rank in reports)
    payload = sum(len(json.dumps(metrics)) for per_rank in reports for metrics in per_rank)
    return {
        "rows_per_step": rows / STEPS,
        "driver_cpu_ms_per_step": 1000 * cpu / STEPS,
        "driver_wall_ms_per_step": 1000 * wall / STEPS,
        # what the controller takes in per step: every rank's report; before, every rank sent
        # rank 0's records and events too
        "controller_kb_per_step": payload / 1024 / STEPS,
        "controller_kb_per_step_if_every_rank_sent_records": len(reports[0]) * lead / 1024 / STEPS,
    }


def measure(repeats: int, worlds: tuple[int, ...]) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "began": time.time(), "repeats": repeats}
    results["cpu"] = cpu()
    results.update(steps=STEPS, steps_per_report=STEPS_PER_REPORT, runs={})
    with tempfile.TemporaryDirectory(prefix="shoal-telemetry-") as tmp:
        for repeat in range(repeats):
            for world in worlds:
                for label, up_to in (("new", 8), ("old", EVERY_RANK))[:: 1 if repeat % 2 == 0 else -1]:
                    reports = worker_reports(world, up_to)
                    result = drive(reports, Path(tmp) / "mlflow.db", f"{label}-{world}-r{repeat}")
                    results["runs"].setdefault(str(world), {}).setdefault(label, []).append(result)
                    print(f"r{repeat} {world:>5} ranks {label}: {result}", flush=True)
    results["ended"] = time.time()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", default=str(RESULTS))
    parser.add_argument("--worlds", type=int, nargs="+", default=list(WORLDS))
    args = parser.parse_args()
    results = measure(args.repeats, tuple(args.worlds))
    Path(args.results).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
