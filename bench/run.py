"""`make bench`: shoal vs torchrun vs bare Ray Train, written to BENCHMARKS.md.

Each repetition runs the three contenders back to back (order rotated between
repetitions); ratios are taken pair by pair within a repetition, then the median
and min-max over repetitions are reported. Absolute numbers on a 2-core machine
are noisy; the ratios are the point.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WARMUP_STEPS = 5


def commands(precision: str, steps: int, out: Path) -> dict[str, list[str]]:
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
        "shoal-1-worker": [*shoal, "--set", "scaling.workers=1"],
        "data": [sys.executable, str(REPO / "bench" / "data_pipeline.py"), "--out", str(out)],
    }


def shoal_result(workdir: Path, run_name: str, started: float) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("bench")
    (run,) = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`shoal.run_name` = '{run_name}'"
    )
    speed = client.get_metric_history(run.info.run_id, "train/tokens_per_s")
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    first = min(speed, key=lambda m: m.step)  # its timestamp is when step 1 ended, on the worker
    steady = [m.value for m in speed if m.step > WARMUP_STEPS + 1]
    wait = client.get_metric_history(run.info.run_id, "train/data_wait_share")
    return {
        "tokens_per_s": statistics.median(steady),
        "first_step_s": first.timestamp / 1000 - started,
        "final_loss": max(loss, key=lambda m: m.step).value,
        "data_wait_share": statistics.median(m.value for m in wait if m.step > WARMUP_STEPS + 1),
    }


def run_one(name: str, precision: str, steps: int, workdir: Path, tag: str) -> dict[str, float]:
    out = workdir / f"{name}-{precision}-{tag}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "BENCH_START": repr(time.time())}
    started = float(env["BENCH_START"])
    done = subprocess.run(
        commands(precision, steps, out)[name],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    if name.startswith("shoal"):
        return shoal_result(workdir, out.stem, started)
    return json.loads(out.read_text())


def summarise(values: list[float]) -> str:
    return f"{statistics.median(values):,.3g} ({min(values):,.3g}-{max(values):,.3g})"


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
    return (
        f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB, no GPU; Python {platform.python_version()}, "
        f"torch {torch.__version__}, Ray {ray.__version__}, MLflow {mlflow.__version__}; "
        f"{time.strftime('%Y-%m-%d')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    args = parser.parse_args()
    names = ["torchrun", "ray", "shoal"]
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="shoal-bench-") as tmp:
        for precision in ("fp32", "bf16"):
            for repeat in range(args.repeats):
                order = names[repeat % 3 :] + names[: repeat % 3]
                for name in order:
                    result = run_one(name, precision, args.steps, Path(tmp), f"r{repeat}")
                    print(f"{precision} r{repeat} {name}: {result}", flush=True)
                    results.setdefault(precision, {}).setdefault(name, []).append(result)
                    Path(args.out).with_suffix(".json").write_text(
                        json.dumps(results)
                    )  # kept if a later run fails
        extra: dict[str, list[dict]] = {"data": [], "shoal-1-worker": []}
        for repeat in range(args.repeats):
            for name, runs in extra.items():
                runs.append(run_one(name, "fp32", args.steps, Path(tmp), f"x{repeat}"))
                print(f"fp32 x{repeat} {name}: {runs[-1]}", flush=True)
    Path(args.out).write_text(render(results, args) + render_extra(results["fp32"], extra))
    print(f"wrote {args.out}")


def render(results: dict, args: argparse.Namespace) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Machine: {machine()}.",
        "",
        "The ~10.8M-parameter byte GPT (6 layers, d_model 384, seq 256) on pytext, 2 workers, "
        f"micro-batch 4, {args.steps} steps, {args.repeats} repetitions; steady state = median step "
        f"after {WARMUP_STEPS} warm-up steps; time to first step = from launching the command to the "
        "end of step 1. Cells: median (min-max).",
        "Reproduce everything: `make bench` (or `.venv/bin/python bench/run.py --repeats 3`).",
        "",
        "| precision | contender | tokens/s | time to first step (s) | command |",
        "| --- | --- | --- | --- | --- |",
    ]
    shown = {
        "torchrun": "`torchrun --standalone --nproc-per-node 2 bench/torchrun_ddp.py --precision P`",
        "ray": "`python bench/ray_train_bare.py --precision P`",
        "shoal": "`shoal run bench/gpt_bench.yaml --set train.precision=P`",
    }
    for precision, by_name in results.items():
        for name, runs in by_name.items():
            lines.append(
                f"| {precision} | {name} | {summarise([r['tokens_per_s'] for r in runs])} | "
                f"{summarise([r['first_step_s'] for r in runs])} | {shown[name]} |"
            )
    lines += [
        "",
        "Ratios, pair by pair within each repetition (target: steady state shoal/torchrun >= 0.95; "
        "time to first step shoal/bare Ray <= 1.2):",
        "",
        "| precision | steady tokens/s shoal/torchrun | steady tokens/s shoal/bare Ray | "
        "first step shoal/bare Ray |",
        "| --- | --- | --- | --- |",
    ]
    for precision, by_name in results.items():
        pairs = list(zip(by_name["shoal"], by_name["torchrun"], by_name["ray"], strict=True))
        lines.append(
            f"| {precision} | {summarise([s['tokens_per_s'] / t['tokens_per_s'] for s, t, _ in pairs])} | "
            f"{summarise([s['tokens_per_s'] / r['tokens_per_s'] for s, _, r in pairs])} | "
            f"{summarise([s['first_step_s'] / r['first_step_s'] for s, _, r in pairs])} |"
        )
    return "\n".join(lines) + "\n"


def render_extra(fp32: dict[str, list[dict]], extra: dict[str, list[dict]]) -> str:
    per_worker = [r["tokens_per_s"] / 256 / 2 for r in fp32["shoal"]]  # rows/s each worker consumes
    headroom = [d["rows_per_s"] / c for d, c in zip(extra["data"], per_worker, strict=False)]
    lines = [
        "",
        "## Data pipeline",
        "",
        "Ray Data read -> preprocess (int64 cast) -> iter_torch_batches on one consumer "
        "(`python bench/data_pipeline.py`), against what one shoal worker consumes (fp32, 2 workers):",
        "",
        "| figure | median (min-max) |",
        "| --- | --- |",
        f"| pipeline rows/s, one consumer | {summarise([r['rows_per_s'] for r in extra['data']])} |",
        f"| rows/s consumed per worker by training | {summarise(per_worker)} |",
        f"| headroom (pipeline / consumption) | {summarise(headroom)} |",
        "| data-wait share of step time, shoal fp32 (target < 2%) | "
        f"{summarise([100 * r['data_wait_share'] for r in fp32['shoal']])} % |",
        "",
        "## Scaling here (2 cores)",
        "",
        "| workers | shoal tokens/s fp32 | command |",
        "| --- | --- | --- |",
        f"| 1 | {summarise([r['tokens_per_s'] for r in extra['shoal-1-worker']])} | "
        "`shoal run bench/gpt_bench.yaml --set scaling.workers=1` |",
        f"| 2 | {summarise([r['tokens_per_s'] for r in fp32['shoal']])} | `shoal run bench/gpt_bench.yaml` |",
        "",
        "No GPU was lent to the session that measured this: no GPU row (tokens/s and MFU at the largest "
        "GPT that fits). The simulated multi-node control-plane figure is not measured yet.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
