"""`make bench-recovery`: what checkpoints and failures cost, into BENCHMARKS.md.

1. Training stall per checkpoint, sync vs async: a ~48M-parameter GPT (FSDP, 2 workers)
   trains 24 steps with a checkpoint every 4 steps, and once without checkpoints; the
   cost of a checkpoint is the extra step time it causes (the save itself, and with
   async the background write competing with the next steps), per checkpoint.
2. Recovery from a SIGKILLed worker: kill time -> end of the first step of the new attempt.
3. Recovery from a removed node (multi-node local cluster, tuned timeouts below).

Every recovery time comes from the sample audit's step timestamps (SHOAL_AUDIT_SAMPLES=1).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import RECOVERY_SECTION as SECTION  # noqa: E402
from bench.report import cpu, machine, summarise  # noqa: E402
from shoal.messages import Metric  # noqa: E402
from tests.integration.helpers import registered, shoal_cli, wait_for, worker_pid  # noqa: E402
from tests.system.conftest import FAST_NODE_FAILURE  # noqa: E402

BIG_GPT = "{n_layers: 12, d_model: 576, n_heads: 8, vocab_size: 256, seq_len: 128, tie_embeddings: true}"
STALL_STEPS, STALL_EVERY, ROWS_PER_STEP = 24, 4, 4


def shoal(args: list[str], cwd: Path, wait: bool = True, **env: str) -> subprocess.Popen:
    proc = shoal_cli(args, cwd, PYTHONPATH=str(REPO), **env)
    if wait:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"shoal {' '.join(args)} failed:\n{err[-3000:]}")
    return proc


def step_seconds(workdir: Path, run_name: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`shoal.run_name` = '{run_name}'",
    )
    return {
        m.step: ROWS_PER_STEP / m.value
        for m in client.get_metric_history(run.info.run_id, Metric.TRAIN_SAMPLES_PER_S)
    }


def stall_run(workdir: Path, mode: str, tag: str) -> dict[int, float]:
    """Seconds each training step took (from MLflow's per-step samples/s)."""
    name = f"stall-{mode}-{tag}"
    overrides = {
        "model.args": BIG_GPT,
        "data.batch_size": "2",
        "parallel.strategy": "fsdp",
        "train.max_steps": str(STALL_STEPS),
        "checkpoint.every_steps": str(STALL_EVERY if mode != "none" else 10_000),
        "checkpoint.async": "true" if mode == "async" else "false",
        "checkpoint.keep": "2",
    }
    args = ["run", str(REPO / "bench" / "gpt_bench.yaml"), "--run-name", name]
    for key, value in overrides.items():
        args += ["--set", f"{key}={value}"]
    shoal(args, workdir)
    return step_seconds(workdir, name)


def first_step_after(run_dir: Path, moment: float) -> float:
    records = [json.loads(line) for path in (run_dir / "audit").glob("rank*.jsonl") for line in path.open()]
    return min(r["time"] for r in records if float(r["attempt"]) > moment) - moment


def worker_kill_recovery(workdir: Path, tag: str) -> float:
    name = f"kill-{tag}"
    args = ["run", str(REPO / "workloads" / "quickstart.yaml"), "--run-name", name]
    args += [
        "--set",
        "train.max_steps=600",
        "--set",
        "checkpoint.every_steps=50",
        "--set",
        "train.eval_every=1000",
    ]
    proc = shoal(args, workdir, wait=False, SHOAL_AUDIT_SAMPLES="1")
    run_dir = workdir / "shoal_runs" / name
    wait_for(lambda: registered(run_dir, "checkpoint-00000100"), 600, "checkpoint 100")
    killed_at = time.time()
    os.kill(worker_pid(run_dir, 1), signal.SIGKILL)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-2000:]
    return first_step_after(run_dir, killed_at)


def node_loss_recovery(workdir: Path, tag: str) -> float:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 1, "_system_config": dict(FAST_NODE_FAILURE), "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=2)
        doomed = cluster.add_node(num_cpus=2)
        name = f"node-{tag}"
        args = ["run", str(REPO / "workloads" / "quickstart.yaml"), "--run-name", name]
        args += ["--address", cluster.address]
        for item in (
            "train.max_steps=600",
            "checkpoint.every_steps=50",
            "train.eval_every=1000",
            "scaling.workers={min: 1, max: 2}",
            "scaling.cpus_per_worker=2",
            "failure.worker_start_timeout_s=10",
        ):
            args += ["--set", item]
        proc = shoal(args, workdir, wait=False, SHOAL_AUDIT_SAMPLES="1")
        run_dir = workdir / "shoal_runs" / name
        wait_for(lambda: registered(run_dir, "checkpoint-00000100"), 600, "checkpoint 100")
        removed_at = time.time()
        cluster.remove_node(doomed, allow_graceful=False)
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-2000:]
        return first_step_after(run_dir, removed_at)
    finally:
        cluster.shutdown()


def stalls(steps: dict[int, float], baseline: dict[int, float]) -> tuple[float, float]:
    """(total extra step time per checkpoint, extra time of the step right after a checkpoint):
    the save blocks the step after it; an async write then competes with the steps that follow."""
    after = [c + 1 for c in range(STALL_EVERY, STALL_STEPS, STALL_EVERY)]
    typical = statistics.median(v for s, v in baseline.items() if s > 1)
    total = sum(v for s, v in steps.items() if s > 1) - sum(v for s, v in baseline.items() if s > 1)
    return total / len(after), statistics.median(steps[s] - typical for s in after)


def render(results: dict[str, list], repeats: int) -> str:
    none = results["none"]
    checkpoints = (STALL_STEPS - 1) // STALL_EVERY
    sync = [stalls(s, n) for s, n in zip(results["sync"], none, strict=True)]
    background = [stalls(a, n) for a, n in zip(results["async"], none, strict=True)]
    ratio = [a[0] / s[0] for a, s in zip(background, sync, strict=True)]
    blocking_ratio = [a[1] / s[1] for a, s in zip(background, sync, strict=True)]
    settings = ", ".join(f"`{k}={v}`" for k, v in FAST_NODE_FAILURE.items())
    return "\n".join(
        [
            SECTION,
            "",
            f"Machine: {machine()}; CPU capability {cpu()}. `make bench-recovery`; {repeats} repetitions, "
            "median (min-max).",
            "",
            "| figure | seconds |",
            "| --- | --- |",
            f"| training stall per checkpoint, sync (48M-param GPT, FSDP, 2 workers, 576 MB with Adam) "
            f"| {summarise([x[0] for x in sync])} |",
            f"| training stall per checkpoint, async | {summarise([x[0] for x in background])} |",
            f"| async / sync stall (ratio) | {summarise(ratio)} |",
            f"| blocking: extra time of the step after a checkpoint, sync | "
            f"{summarise([x[1] for x in sync])} |",
            f"| blocking: extra time of the step after a checkpoint, async | "
            f"{summarise([x[1] for x in background])} |",
            f"| async / sync blocking (ratio) | {summarise(blocking_ratio)} |",
            f"| SIGKILLed worker -> next step (quickstart, 2 workers) | {summarise(results['kill'])} |",
            f"| removed node -> next step (elastic 1-2 workers, 3-node local cluster) "
            f"| {summarise(results['node'])} |",
            "",
            "Stall = extra step time over the same 23 steps without checkpoints, divided by the "
            f"{checkpoints} checkpoints taken in them. Node-loss settings: head `_system_config` {settings} "
            "(GCS declares a node dead after 3 missed 1 s health checks instead of 5 missed 3 s ones) and "
            "`failure.worker_start_timeout_s: 10` (Ray Train's RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S: how "
            "long a restart waits to place the old number of workers before shrinking; default 60 s, "
            "shoal's default 30 s). With Ray's defaults FACTS.md measured 47-74 s.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    args = parser.parse_args()
    results: dict[str, list] = {k: [] for k in ("none", "sync", "async", "kill", "node")}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-recovery-") as tmp:
        workdir = Path(tmp)
        for repeat in range(args.repeats):
            for mode in ("none", "sync", "async"):
                results[mode].append(stall_run(workdir, mode, f"r{repeat}"))
                print(
                    f"stall {mode} r{repeat}: {sum(results[mode][-1].values()):.2f} s of step time",
                    flush=True,
                )
            results["kill"].append(worker_kill_recovery(workdir, f"r{repeat}"))
            print(f"worker kill r{repeat}: {results['kill'][-1]:.1f} s", flush=True)
            results["node"].append(node_loss_recovery(workdir, f"r{repeat}"))
            print(f"node loss r{repeat}: {results['node'][-1]:.1f} s", flush=True)
            (REPO / "bench" / "recovery-results.json").write_text(json.dumps(results))
    out = Path(args.out)
    text = out.read_text() if out.exists() else "# Benchmarks\n"
    before = text.split(SECTION)[0].rstrip() + "\n\n"
    out.write_text(before + render(results, args.repeats))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
