"""`make bench`: shoal vs torchrun vs bare Ray Train, written to BENCHMARKS.md.

Each repetition runs the contenders back to back (order rotated between
repetitions), torchrun before the first and again after each, so that every
contender's ratio to torchrun is taken against the runs just around it; ratios are
taken within a repetition, then the median and min-max over repetitions are
reported. Absolute numbers on a 2-core machine are noisy; the ratios are the point.
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import WARMUP_STEPS  # noqa: E402
from bench.cpu_share import CpuSampler  # noqa: E402
from bench.data_plane_report import data_plane, val_parity  # noqa: E402
from bench.gpu_report import section as one_gpu  # noqa: E402
from bench.multinode import three_node_cluster  # noqa: E402
from bench.report import RECOVERY_SECTION, commit_ab, cpu, machine, render  # noqa: E402
from bench.scale_report import control_plane, levers, ray_idle  # noqa: E402
from bench.telemetry_report import telemetry  # noqa: E402
from shoal.messages import Metric  # noqa: E402

BIN = Path(sys.executable).parent


def commands(precision: str, steps: int, out: Path, address: str = "") -> dict[str, list[str]]:
    common = ["--steps", str(steps), "--precision", precision, "--out", str(out)]
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    shoal = [
        str(BIN / "shoal"),
        "run",
        str(REPO / "bench" / "gpt_bench.yaml"),
        "--run-name",
        out.stem,
        "--set",
        f"train.max_steps={steps}",
        "--set",
        f"train.precision={precision}",
    ]
    return {
        "torchrun": [*torchrun, str(REPO / "bench" / "torchrun_ddp.py"), *common],
        "ray": [sys.executable, str(REPO / "bench" / "ray_train_bare.py"), *common],
        "shoal": shoal,
        # The optimizer kernel the peers run (torch's default): shoal's own cost, the kernel aside.
        "shoal-for-loop": [*shoal, "--set", "train.optimizer.implementation=for-loop"],
        "shoal-1-worker": [*shoal, "--set", "scaling.workers=1"],
        "shoal-3-nodes": [*shoal, "--address", address],
        "data": [sys.executable, str(REPO / "bench" / "data_pipeline.py"), "--out", str(out)],
    }


def shoal_result(workdir: Path, run_name: str, started: float) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("bench")
    (run,) = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`shoal.run_name` = '{run_name}'"
    )
    speed = client.get_metric_history(run.info.run_id, Metric.TRAIN_TOKENS_PER_S)
    loss = client.get_metric_history(run.info.run_id, Metric.TRAIN_LOSS)
    first = min(speed, key=lambda m: m.step)  # its timestamp is when step 1 ended, on the worker
    steady = [m.value for m in speed if m.step > WARMUP_STEPS + 1]
    window = [m.timestamp / 1000 for m in speed if m.step >= WARMUP_STEPS + 1]
    wait = client.get_metric_history(run.info.run_id, Metric.TRAIN_DATA_WAIT_SHARE)
    return {
        "tokens_per_s": statistics.median(steady),
        "first_step_s": first.timestamp / 1000 - started,
        "final_loss": max(loss, key=lambda m: m.step).value,
        "data_wait_share": statistics.median(m.value for m in wait if m.step > WARMUP_STEPS + 1),
        "steady_from": min(window),
        "steady_to": max(window),
    }


def run_one(
    name: str, precision: str, steps: int, workdir: Path, tag: str, address: str = ""
) -> dict[str, Any]:
    out = workdir / f"{name}-{precision}-{tag}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "BENCH_START": repr(time.time())}
    started = float(env["BENCH_START"])
    with CpuSampler() as sampler:
        done = subprocess.run(
            commands(precision, steps, out, address)[name],
            cwd=workdir,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = (
        shoal_result(workdir, out.stem, started) if name.startswith("shoal") else json.loads(out.read_text())
    )
    if "steady_from" in result:
        result["cpu"] = sampler.shares(result["steady_from"], result["steady_to"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    parser.add_argument("--results", default=str(REPO / "bench" / "results.json"))
    parser.add_argument("--render-only", action="store_true", help="rewrite the file from --results")
    args = parser.parse_args()
    if not args.render_only:
        measure(args)
    results = json.loads(Path(args.results).read_text())
    out = Path(args.out)
    kept = out.read_text().partition(RECOVERY_SECTION) if out.exists() else ("", "", "")
    text = render(results)
    commits = REPO / "bench" / "results_commits.json"  # bench/compare_commits.py's, when run
    if commits.exists():
        text += "\n".join(commit_ab(json.loads(commits.read_text()))) + "\n"
    plane = REPO / "bench" / "results_data_plane.json"  # bench/data_plane.py's, when run
    if plane.exists():
        text += "\n".join(data_plane(json.loads(plane.read_text()))) + "\n"
    parity = REPO / "bench" / "results_val_parity.json"  # bench/val_parity.py's, when run
    if parity.exists():
        text += "\n".join(val_parity(json.loads(parity.read_text()))) + "\n"
    telemetry_runs = REPO / "bench" / "results_telemetry.json"  # bench/telemetry.py's, when run
    if telemetry_runs.exists():
        text += "\n".join(telemetry(json.loads(telemetry_runs.read_text()))) + "\n"
    for name, section in (("control_plane", control_plane), ("levers", levers), ("ray_idle", ray_idle)):
        saved = REPO / "bench" / f"results_{name}.json"  # written by bench/{name}.py
        if saved.exists():
            text += "\n".join(section(json.loads(saved.read_text()))) + "\n"
    one_gpu_runs = REPO / "bench" / "results_gpu.json"  # `make gpu-check`'s, when run on a GPU
    if one_gpu_runs.exists():
        text += "\n" + "\n".join(one_gpu(json.loads(one_gpu_runs.read_text()))) + "\n"
    if kept[1]:  # `make bench-recovery`'s section stays
        text += "\n" + kept[1] + kept[2]
    out.write_text(text)
    print(f"wrote {out}")


def measure(args: argparse.Namespace) -> None:
    """Every contender, repetition by repetition; results saved as they come."""
    results: dict[str, Any] = {
        "machine": machine(),
        "cpu": cpu(),
        "steps": args.steps,
        "repeats": args.repeats,
    }
    results["began"], runs = time.time(), results.setdefault("runs", {})

    def record(precision: str, name: str, tag: str, address: str = "", keep: bool = True) -> dict[str, Any]:
        result = run_one(name, precision, args.steps, Path(tmp), tag, address)
        if keep:
            runs.setdefault(precision, {}).setdefault(name, []).append(result)
        shown = {k: round(v, 4) for k, v in result.items() if isinstance(v, float)}
        print(f"{precision} {tag} {name}: {shown}", flush=True)
        Path(args.results).write_text(json.dumps(results, indent=1))
        return result

    # The host's speed drifts (torchrun alone varied 2,418-3,425 tokens/s over 20 minutes here):
    # each contender runs between two torchrun runs, its reference (report.py's `to_torchrun`).
    names = ["ray", "shoal", "shoal-for-loop"]
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        for precision in ("fp32", "bf16"):
            for repeat in range(args.repeats):
                before = record(precision, "torchrun", f"r{repeat}")["tokens_per_s"]
                for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                    result = record(precision, name, f"r{repeat}")
                    after = record(precision, "torchrun", f"r{repeat}-after-{name}", keep=False)
                    result["torchrun_around"] = [before, after["tokens_per_s"]]
                    before = after["tokens_per_s"]
                    Path(args.results).write_text(json.dumps(results, indent=1))
                if precision == "fp32":  # paired with this repetition's single-node shoal
                    with three_node_cluster() as address:
                        record(precision, "shoal-3-nodes", f"r{repeat}", address)
        for repeat in range(args.repeats):
            record("fp32", "data", f"x{repeat}")
            record("fp32", "shoal-1-worker", f"x{repeat}")
    results["ended"] = time.time()
    Path(args.results).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
