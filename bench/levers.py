"""Which Ray settings of a training cluster help shoal's steady state: `python bench/levers.py`.

Each repetition runs torchrun once and then `shoal run --address` (bench/gpt_bench.yaml, the
same run as `make bench`'s shoal) on a one-node cluster started with Ray's defaults and
with each lever pulled alone, order rotated; every figure is shoal's steady tokens/s over
torchrun's of the same repetition, and each lever's gain is paired with the defaults' run
of the same repetition.

Levers (what a user sets on `ray start` or in a cluster definition):
- metrics: `RAY_enable_metrics_collection=false` (Ray's processes stop recording and
  exporting their own metrics; the dashboard's graphs go empty);
- log_monitor: `--include-log-monitor=false` (no process tails the workers' logs to
  the drivers; `shoal jobs logs` and the log files still have them);
- prestart: `RAY_enable_worker_prestart=false`, `RAY_prestart_worker_first_driver=false`
  (no idle Python workers started ahead of demand);
- dashboard: `--include-dashboard=false` (no dashboard process; the per-node agent stays,
  Ray starts it with every raylet);
- lean: every lever above at once.
Ray Data's stats actors are not a lever here: shoal's workers read their own share of the
data without Ray Data, and no Ray Data actor runs during training.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import environment  # noqa: E402
from bench.report import cpu, machine  # noqa: E402
from bench.run import run_one  # noqa: E402

RESULTS = REPO / "bench" / "results_levers.json"
NO_PRESTART = {"RAY_enable_worker_prestart": "false", "RAY_prestart_worker_first_driver": "false"}
LEVERS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "metrics": {"env": {"RAY_enable_metrics_collection": "false"}},
    "log_monitor": {"node": {"include_log_monitor": False}},
    "prestart": {"env": NO_PRESTART},
    "dashboard": {"node": {"include_dashboard": False}},
    "lean": {
        "env": {"RAY_enable_metrics_collection": "false", **NO_PRESTART},
        "node": {"include_log_monitor": False, "include_dashboard": False},
    },
}


@contextmanager
def cluster_with(lever: dict[str, Any]) -> Iterator[str]:
    """A one-node cluster with Ray's defaults but for the lever; yields its address."""
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 4, "include_dashboard": True, **lever.get("node", {})}
    with environment(lever.get("env", {})):  # inherited by the node's processes
        cluster = Cluster(initialize_head=True, connect=False, head_node_args=node)
        try:
            cluster.wait_for_nodes()
            yield cluster.address
        finally:
            cluster.shutdown()


def measure(repeats: int, steps: int) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": machine(), "cpu": cpu(), "steps": steps, "repeats": repeats}
    results["began"], runs = time.time(), results.setdefault("runs", [])
    names = list(LEVERS)
    with tempfile.TemporaryDirectory(prefix="shoal-bench-levers-") as tmp:
        for repeat in range(repeats):
            done = {"torchrun": run_one("torchrun", "fp32", steps, Path(tmp), f"r{repeat}")["tokens_per_s"]}
            for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                with cluster_with(LEVERS[name]) as address:
                    tag = f"{name}-r{repeat}"
                    done[name] = run_one("shoal-3-nodes", "fp32", steps, Path(tmp), tag, address)[
                        "tokens_per_s"
                    ]
                print(
                    f"r{repeat} {name}: {done[name]:.0f} tokens/s ({done[name] / done['torchrun']:.3f})",
                    flush=True,
                )
            runs.append(done)
            RESULTS.write_text(json.dumps(results, indent=1))
    results["ended"] = time.time()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    RESULTS.write_text(json.dumps(measure(args.repeats, args.steps), indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
