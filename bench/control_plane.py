"""shoal's control plane against bare Ray Train as workers grow: `python bench/control_plane.py`.

A tiny GPT (so that the step is mostly coordination: gradient all-reduce, shoal's per-step
stats all-reduce and its reports, Ray Train's own machinery) trains on a simulated
multi-node cluster (`ray.cluster_utils.Cluster`: a head with no CPUs, the driver's side,
and two worker nodes sharing the workers) at 2, 4 and 8 workers. Each repetition runs the
bare Ray Train script (bench/ray_train_bare.py), `shoal run`, and `shoal run` with the bare
script's optimizer kernel on the same cluster, order rotated; the ratios are paired within a
repetition.

Steady step time: the median after warm-up of the intervals between one step's end and the
next's, as rank 0 clocks them (bare: `time.time()` at each step end; shoal: its
`time/step_s`, measured the same way with `perf_counter`). Time to first step: from
launching the process to the end of step 1. shoal's report path: the seconds per step its
workers spent in Ray Train's report (`time/report_s`, summed over the run, over the
steps), and its per-step all-reduce is part of the step time compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import MICRO_BATCH, WARMUP_STEPS, data_dir, environment  # noqa: E402
from bench.report import cpu, machine  # noqa: E402
from shoal.launch.cluster import lean_ray_env  # noqa: E402
from shoal.messages import Metric  # noqa: E402

RESULTS = REPO / "bench" / "results_control_plane.json"
TINY_GPT = {"n_layers": 1, "d_model": 32, "n_heads": 2, "vocab_size": 256, "seq_len": 32}
WORKERS = (2, 4, 8)
# About 10 s of steady state at each size (a step takes ~5, ~15 and ~35 ms here): 300 steps of
# 5 ms left the 2-worker ratio within +-15% from one repetition to the next.
STEPS = {2: 2000, 4: 800, 8: 400}
BIN = Path(sys.executable).parent


@contextmanager
def simulated_cluster(workers: int) -> Iterator[str]:
    """A head without CPUs and two worker nodes, each with room for half the workers and one
    CPU more (Ray Data's tasks, on the bare side); yields the address to attach to."""
    from ray.cluster_utils import Cluster

    # The nodes' workers import the bare script's training function from bench/.
    lean = {
        **lean_ray_env(),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    with environment(lean):
        cluster = Cluster(
            initialize_head=True, connect=False, head_node_args={"num_cpus": 0, "include_dashboard": False}
        )
        try:
            for _ in range(2):
                cluster.add_node(num_cpus=workers // 2 + 1)
            cluster.wait_for_nodes()
            yield cluster.address
        finally:
            cluster.shutdown()


def steady_step_s(step_ends: list[float]) -> float:
    ends = sorted(step_ends)[WARMUP_STEPS:]
    return statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False))


def bare(address: str, workers: int, steps: int, workdir: Path) -> dict[str, Any]:
    out = workdir / f"bare-{workers}-{time.time_ns()}.json"
    command = [sys.executable, str(REPO / "bench" / "ray_train_bare.py"), "--steps", str(steps)]
    command += ["--workers", str(workers), "--gpt", json.dumps(TINY_GPT), "--address", address]
    _run(command + ["--out", str(out)], workdir)
    result = json.loads(out.read_text())
    return {"step_s": steady_step_s(result["step_ends"]), "first_step_s": result["first_step_s"]}


def shoal(address: str, workers: int, steps: int, workdir: Path, kernel: str = "auto") -> dict[str, Any]:
    name = f"cp-{workers}-{time.time_ns()}"
    command = [str(BIN / "shoal"), "run", str(REPO / "bench" / "gpt_bench.yaml"), "--address", address]
    command += ["--run-name", name]
    settings = {
        "model.args": json.dumps(TINY_GPT),
        "data.batch_size": MICRO_BATCH,
        "scaling.workers": workers,
        "scaling.threads_per_worker": 1,  # as Ray gives bare's workers (OMP_NUM_THREADS = 1 CPU)
        "train.max_steps": steps,
        "tracking.log_model": "false",
        "train.optimizer.implementation": kernel,
    }
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    started = _run(command, workdir)
    return shoal_metrics(workdir, name, started, steps)


def shoal_metrics(workdir: Path, name: str, started: float, steps: int) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`shoal.run_name` = '{name}'",
    )
    steps_s = client.get_metric_history(run.info.run_id, Metric.TIME_STEP_S)
    first = min(steps_s, key=lambda m: m.step)  # its timestamp is when step 1 ended, on the worker
    reports = client.get_metric_history(run.info.run_id, Metric.TIME_REPORT_S)
    return {
        # The value is the worker's own step-end-to-step-end interval (perf_counter): MLflow's
        # timestamps are whole milliseconds, too coarse for a 5 ms step.
        "step_s": statistics.median(m.value for m in steps_s if m.step > WARMUP_STEPS + 1),
        "first_step_s": first.timestamp / 1000 - started,
        "report_s_per_step": sum(m.value for m in reports) / steps,
        "reports": len(reports),  # a point only at the steps after a report
    }


def shoal_for_loop(address: str, workers: int, steps: int, workdir: Path) -> dict[str, Any]:
    """shoal with the optimizer kernel the bare script runs (torch's default for-loop AdamW on
    CPU; shoal's default is the fused one): shoal's own cost, the kernel aside."""
    return shoal(address, workers, steps, workdir, kernel="for-loop")


CONTENDERS = [("bare", bare), ("shoal", shoal), ("shoal-for-loop", shoal_for_loop)]


def _run(command: list[str], workdir: Path) -> float:
    started = time.time()
    env = {**os.environ, "PYTHONPATH": str(REPO), "BENCH_START": repr(started)}
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{command[:3]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return started


def measure(repeats: int, steps: dict[int, int], sizes: tuple[int, ...]) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": machine(),
        "cpu": cpu(),
        "steps": {str(workers): steps[workers] for workers in sizes},
        "repeats": repeats,
        "model": TINY_GPT,
        "began": time.time(),
        "runs": {},
    }
    data_dir(TINY_GPT["seq_len"])  # prepared before any contender's clock starts
    with tempfile.TemporaryDirectory(prefix="shoal-bench-cp-") as tmp:
        for repeat in range(repeats):
            for workers in sizes:
                with simulated_cluster(workers) as address:
                    pair = {}
                    for name, contender in CONTENDERS[repeat % 3 :] + CONTENDERS[: repeat % 3]:
                        pair[name] = contender(address, workers, steps[workers], Path(tmp))
                        print(f"r{repeat} {workers} workers {name}: {pair[name]}", flush=True)
                results["runs"].setdefault(str(workers), []).append(pair)
                RESULTS.write_text(json.dumps(results, indent=1))
    results["ended"] = time.time()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, help=f"steps at every size (default: {STEPS})")
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKERS))
    args = parser.parse_args()
    steps = {w: args.steps or STEPS.get(w, 400) for w in args.workers}
    results = measure(args.repeats, steps, tuple(args.workers))
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
