"""Validation numbers with the old pipeline and the new, same workloads and seeds (issue 16,
item 6): the shuffle and the reading changed, what a model learns must not.

    .venv/bin/python bench/val_parity.py [--base abd444d] [--seeds 3]

Two workloads, each trained with seeds 0.. at BASE (checked out into a temporary git
worktree, first on PYTHONPATH) and here: the quickstart (digits CNN, 2 workers, 400 steps)
and a small byte-level GPT on the pytext corpus (2 layers, d_model 128, fp32, 150 steps,
2 workers). The final evaluation's val/loss (and accuracy) of each run is saved to
bench/results_val_parity.json; the noise is the spread over seeds within a pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import cpu, machine  # noqa: E402

BIN = Path(sys.executable).parent
WORKLOADS = {
    "quickstart": ("workloads/quickstart.yaml", ["train.eval_every=400"], ["val/loss", "val/accuracy"]),
    "gpt_pytext": (
        "workloads/gpt_pytext.yaml",
        [
            "model.args={n_layers: 2, d_model: 128, n_heads: 4, vocab_size: 256, seq_len: 128}",
            "data.seq_len=128",
            "train.precision=fp32",
            "train.max_steps=150",
            "train.eval_every=150",
            "train.schedule.warmup_steps=15",
        ],
        ["val/loss"],
    ),
}


def final_values(workdir: Path, experiment: str, name: str, metrics: list[str]) -> dict[str, float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([found.experiment_id], filter_string=f"tags.`shoal.run_name` = '{name}'")
    return {
        m: max(client.get_metric_history(run.info.run_id, m), key=lambda p: p.step).value for m in metrics
    }


def train(
    workdir: Path, platform: Path, workload: str, seed: int, pipeline: str, eval_rows: list[str]
) -> dict:
    spec, overrides, metrics = WORKLOADS[workload]
    name = f"{workload}-{pipeline}-s{seed}"
    command = [str(BIN / "shoal"), "run", str(REPO / spec), "--run-name", name, "--set", f"train.seed={seed}"]
    for item in [*overrides, *eval_rows]:
        command += ["--set", item]
    env = {**os.environ, "PYTHONPATH": f"{platform}:{REPO}"}
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return final_values(workdir, workload, name, metrics)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", default="abd444d", help="a commit with the old pipeline")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--results", default=str(REPO / "bench" / "results_val_parity.json"))
    args = parser.parse_args()
    results: dict = {"machine": machine(), "cpu": cpu(), "base": args.base}
    results["began"], runs = time.time(), results.setdefault("runs", {})
    with tempfile.TemporaryDirectory(prefix="shoal-val-parity-") as tmp:
        workdir, base = Path(tmp), Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.base], check=True
        )
        platforms = {"old": base / "platform", "new": REPO / "platform"}
        # train.eval_batches counted per worker before and for the whole set now: 2 workers x 16
        eval_rows = {"old": ["train.eval_batches=16"], "new": ["train.eval_batches=32"]}
        try:
            for workload in WORKLOADS:
                for seed in range(args.seeds):
                    for pipeline in ("old", "new"):
                        value = train(
                            workdir, platforms[pipeline], workload, seed, pipeline, eval_rows[pipeline]
                        )
                        runs.setdefault(workload, {}).setdefault(pipeline, []).append(value)
                        print(f"{workload} seed {seed} {pipeline}: {value}", flush=True)
                        Path(args.results).write_text(json.dumps(results, indent=1))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    results["ended"] = time.time()
    Path(args.results).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
