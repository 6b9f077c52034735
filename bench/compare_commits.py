"""Steady tokens/s of shoal at another commit and at this checkout, each paired with torchrun.

    .venv/bin/python bench/compare_commits.py BASE_REV [--repeats 4] [--precision fp32]

`make bench`'s shoal and torchrun contenders (same commands, same model), with a
second shoal: BASE_REV checked out into a temporary git worktree and put first on
PYTHONPATH (Ray's workers inherit it). Each repetition runs torchrun, shoal at
BASE_REV and shoal here back to back, order rotated; the shoal/torchrun ratio is
taken within the repetition. Prints the medians (min-max) and the machine, and saves the
results to bench/results_commits.json (`--results`), which BENCHMARKS.md shows.
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

from bench.report import cpu, machine  # noqa: E402
from bench.run import commands, shoal_result  # noqa: E402


def measure(name: str, precision: str, steps: int, workdir: Path, tag: str, platform: Path) -> float:
    out = workdir / f"{name}-{precision}-{tag}.json"
    started = time.time()
    env = {**os.environ, "PYTHONPATH": f"{platform}:{REPO}", "BENCH_START": repr(started)}
    contender = "torchrun" if name == "torchrun" else "shoal"
    done = subprocess.run(
        commands(precision, steps, out)[contender], cwd=workdir, env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    if contender == "torchrun":
        return json.loads(out.read_text())["tokens_per_s"]
    return shoal_result(workdir, out.stem, started)["tokens_per_s"]


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base", help="the commit to compare this checkout with")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--results", default=str(REPO / "bench" / "results_commits.json"))
    args = parser.parse_args()
    began = time.time()
    results: dict[str, list[float]] = {"torchrun": [], "base": [], "here": []}
    ratios: dict[str, list[float]] = {"base": [], "here": []}
    with tempfile.TemporaryDirectory(prefix="shoal-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.base], check=True
        )
        try:
            platforms = {"torchrun": REPO / "platform", "base": base / "platform", "here": REPO / "platform"}
            names = list(platforms)
            for repeat in range(args.repeats):
                speed: dict[str, Any] = {}
                for name in names[repeat % 3 :] + names[: repeat % 3]:
                    speed[name] = measure(
                        name, args.precision, args.steps, Path(tmp), f"r{repeat}", platforms[name]
                    )
                    results[name].append(speed[name])
                for name in ratios:
                    ratios[name].append(speed[name] / speed["torchrun"])
                print(f"r{repeat}: " + ", ".join(f"{n} {v:,.0f}" for n, v in speed.items()), flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
    measured_on = f"{machine()}; CPU capability {cpu()}"
    print(f"machine: {measured_on}")
    print(f"precision {args.precision}, {args.repeats} repetitions, {args.steps} steps")
    for name in results:
        print(f"tokens/s {name}: {summary(results[name])}")
    print(f"shoal/torchrun at {args.base}: {summary(ratios['base'])}")
    print(f"shoal/torchrun here: {summary(ratios['here'])}")
    rev = ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]
    here = subprocess.run(rev, capture_output=True, text=True)
    saved = {
        "machine": measured_on,
        "base": args.base,
        "here": here.stdout.strip(),
        "precision": args.precision,
        "steps": args.steps,
        "began": began,
        "tokens_per_s": results,
    }
    Path(args.results).write_text(json.dumps(saved, indent=1))


if __name__ == "__main__":
    main()
