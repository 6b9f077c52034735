"""The data plane, old pipeline against new, on a read-bound workload (issue 16, item 9).

    .venv/bin/python bench/data_plane.py [--base abd444d] [--rows 1048576] [--repeats 3]

The bench writes about 1 GiB of parquet (rows of 256 float32 features, row groups of
2,048 rows) and trains a tiny MLP on it, one epoch at a time, with shoal at BASE (the
pipeline before each rank read only its own share: every rank iterated the whole
training set through Ray Data and kept its slots) and shoal here. BASE is checked out
into a temporary git worktree and put first on PYTHONPATH, as bench/compare_commits.py
does. It measures:

- bytes of the training files read in one epoch, summed over every process of the run
  (driver, Ray Data tasks, workers), at 1, 2 and 4 workers. Counted by the kernel:
  the run goes under `strace -f`, and the byte counts that its read syscalls on the
  dataset's files returned are added up. The same method for both pipelines.
- samples/s and the data-wait share of step time at 4 workers, medians of the steady
  steps, without strace, `--repeats` pairs, order rotated.
- the first step's data wait after a resume at 10 % and at 90 % of an epoch (2 workers):
  the time from asking for the first batch to having it.

Results go to bench/results_data_plane.json; bench/run.py renders them into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import cpu, machine  # noqa: E402

BIN = Path(sys.executable).parent
FEATURES, PER_GROUP, FILES = 256, 2048, 8
MICRO, GLOBAL_BATCH = 512, 2048
WORKERS = (1, 2, 4)
READ = re.compile(r"^(?:p?read(?:64)?|p?readv2?)\((\d+)<([^>]+)>.*\)\s+=\s+(\d+)$")


def write_dataset(root: Path, rows: int) -> int:
    """`rows` rows (id, 256 random float32 features, a label) in FILES files; their size."""
    (root / "train").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index, part in enumerate(np.array_split(np.arange(rows), FILES)):
        x = rng.random((len(part), FEATURES), dtype=np.float32)
        table = pa.table(
            {
                "id": pa.array(part),
                "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), FEATURES),
                "y": pa.array(rng.integers(0, 10, len(part))),
            }
        )
        path = root / "train" / f"part-{index:02d}.parquet"
        pq.write_table(table, path, row_group_size=PER_GROUP, use_dictionary=False)  # random floats
    return sum(p.stat().st_size for p in (root / "train").glob("*.parquet"))


def workload(data: Path, workers: int, **train: Any) -> dict[str, Any]:
    return {
        "name": "data-plane",
        "model": {"family": "mlp", "args": {"in_features": FEATURES, "hidden": 16, "layers": 1}},
        "data": {"train": {"path": str(data / "train")}, "batch_size": MICRO},
        "train": {"global_batch_size": GLOBAL_BATCH, "optimizer": {"name": "adamw", "lr": 1e-3}, **train},
        "scaling": {"workers": workers, "threads_per_worker": 1},
        "checkpoint": {"every_steps": 100_000, "storage": "./shoal_runs"},
        "tracking": {"experiment": "data-plane"},
    }


def shoal(workdir: Path, platform: Path, spec: dict[str, Any], name: str, trace: Path | None = None) -> None:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    command = [str(BIN / "shoal"), "run", str(path), "--run-name", name]
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        strace = ["strace", "-f", "-ff", "-qq", "-s", "0", "-y", "-e", "signal=none"]
        command = [*strace, "-e", "trace=read,pread64,readv,preadv,preadv2", "-o", str(trace / "t"), *command]
    env = {**os.environ, "PYTHONPATH": f"{platform}:{REPO}", "SHOAL_DATA_CACHE": str(workdir / "cache")}
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def traced_bytes(trace: Path, data: Path) -> int:
    """Bytes that read syscalls on the dataset's files returned, over every traced process."""
    prefix, total = str(data / "train"), 0
    for path in trace.iterdir():
        for line in path.read_text(errors="replace").splitlines():
            found = READ.match(line)
            if found and found.group(2).startswith(prefix):
                total += int(found.group(3))
    return total


def history(workdir: Path, name: str, metric: str) -> dict[int, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("data-plane")
    (run,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.`shoal.run_name` = '{name}'")
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, metric)}


def epoch_bytes(workdir: Path, platform: Path, data: Path, workers: int, tag: str) -> dict[str, float]:
    name = f"bytes-{tag}-{workers}"
    shoal(workdir, platform, workload(data, workers, epochs=1), name, workdir / "trace" / name)
    measured = {"traced": float(traced_bytes(workdir / "trace" / name, data))}
    counted = history(workdir, name, "data/bytes_read")  # the new pipeline's own count
    if counted:
        measured["counted"] = max(counted.values())
    return measured


def speed(workdir: Path, platform: Path, data: Path, tag: str) -> dict[str, float]:
    name = f"speed-{tag}"
    shoal(workdir, platform, workload(data, 4, epochs=1), name)
    samples = history(workdir, name, "train/samples_per_s")
    wait = history(workdir, name, "train/data_wait_share")
    steady = [s for s in samples if s > 5]
    return {
        "samples_per_s": statistics.median(samples[s] for s in steady),
        "data_wait_share": statistics.median(wait[s] for s in steady if s in wait),
    }


def resume_wait(workdir: Path, platform: Path, data: Path, tag: str, fraction: float, steps: int) -> float:
    """Train to `fraction` of an epoch, then resume it: the first resumed step's data wait."""
    name, at = f"resume-{tag}-{int(fraction * 100)}", int(steps * fraction)
    shoal(workdir, platform, workload(data, 2, max_steps=at), name)
    shoal(workdir, platform, workload(data, 2, max_steps=at + 3), name)
    return history(workdir, name, "time/data_wait_s")[at + 1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="abd444d", help="a commit with the old pipeline")
    parser.add_argument("--rows", type=int, default=1_048_576)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", default=str(REPO / "bench" / "results_data_plane.json"))
    args = parser.parse_args()
    results: dict[str, Any] = {"machine": machine(), "cpu": cpu()}
    results.update(base=args.base, rows=args.rows, began=time.time())
    with tempfile.TemporaryDirectory(prefix="shoal-data-plane-") as tmp:
        workdir, data, base = Path(tmp), Path(tmp) / "data", Path(tmp) / "base"
        results["dataset_bytes"] = write_dataset(data, args.rows)
        steps = args.rows // GLOBAL_BATCH
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.base], check=True
        )
        platforms = {"old": base / "platform", "new": REPO / "platform"}
        try:
            measure(args, results, workdir, data, platforms, steps)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    results["ended"] = time.time()
    Path(args.results).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.results}")


def measure(args, results: dict[str, Any], workdir: Path, data: Path, platforms: dict, steps: int) -> None:
    def save(key: str, value: Any) -> None:
        results.setdefault(key, {}).setdefault(pipeline, []).append(value)
        print(f"{key} {pipeline}: {value}", flush=True)
        Path(args.results).write_text(json.dumps(results, indent=1))

    for workers in WORKERS:
        for pipeline in ("old", "new"):
            save(f"bytes_{workers}", epoch_bytes(workdir, platforms[pipeline], data, workers, pipeline))
    for repeat in range(args.repeats):
        for pipeline in ("old", "new")[repeat % 2 :] + ("old", "new")[: repeat % 2]:
            save("speed_4", speed(workdir, platforms[pipeline], data, f"{pipeline}-r{repeat}"))
    for pipeline in ("old", "new"):
        for fraction in (0.1, 0.9):
            wait = resume_wait(workdir, platforms[pipeline], data, pipeline, fraction, steps)
            save(f"resume_{int(fraction * 100)}", wait)


if __name__ == "__main__":
    main()
