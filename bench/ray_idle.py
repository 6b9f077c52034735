"""What one idle Ray worker process costs: `python bench/ray_idle.py`.

Every Ray worker process (Ray Train's controller, placement-group cleaner and synchronization
actor, Ray Data's coordinators, shoal's report queue, a prestarted idle worker) runs Ray's
task-execution loop, whose main thread wakes every 10 ms to check for signals, taking the GIL
each time (CoreWorker::RunTaskExecutionLoop; the period is compiled into Ray, not a setting).
This measures that floor on the machine at hand: a local Ray started as `shoal run` starts one,
actors that do nothing, and over a window their main threads' wake-ups per second and the CPU
their processes take, in cores. It is the part of item 5's gap to torchrun that no cluster
setting removes: torchrun's ranks have no such processes beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import environment  # noqa: E402
from bench.cpu_share import cpu_seconds  # noqa: E402
from bench.report import cpu, machine  # noqa: E402
from shoal.launch.cluster import lean_ray_env  # noqa: E402

RESULTS = REPO / "bench" / "results_ray_idle.json"


def main_thread_counters(pid: int) -> tuple[float, int]:
    """(CPU seconds, voluntary context switches) of a process's main thread."""
    thread = Path(f"/proc/{pid}/task/{pid}")
    status = (thread / "status").read_text().splitlines()
    switches = next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
    return cpu_seconds(thread / "stat"), switches


def measure_once(actors: int, window_s: float) -> dict[str, float]:
    import ray

    with environment(lean_ray_env()):
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:

        @ray.remote(num_cpus=0)
        class Idle:
            def pid(self) -> int:
                return os.getpid()

        handles = [Idle.remote() for _ in range(actors)]
        pids = ray.get([handle.pid.remote() for handle in handles])
        time.sleep(5)  # past the actors' start
        before = [(main_thread_counters(pid), cpu_seconds(Path(f"/proc/{pid}/stat"))) for pid in pids]
        time.sleep(window_s)
        after = [(main_thread_counters(pid), cpu_seconds(Path(f"/proc/{pid}/stat"))) for pid in pids]
    finally:
        ray.shutdown()
    per_actor = [
        (
            (a_main[1] - b_main[1]) / window_s,  # main thread's wake-ups per second
            (a_main[0] - b_main[0]) / window_s,  # main thread's cores
            (a_all - b_all) / window_s,  # the whole process's cores
        )
        for (b_main, b_all), (a_main, a_all) in zip(before, after, strict=True)
    ]
    return {
        "wakeups_per_s": statistics.mean(w for w, _, _ in per_actor),
        "main_thread_cores": statistics.mean(m for _, m, _ in per_actor),
        "process_cores": statistics.mean(p for _, _, p in per_actor),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--actors", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=20.0)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "machine": machine(),
        "cpu": cpu(),
        "began": time.time(),
        "repeats": args.repeats,
        "actors": args.actors,
        "window_s": args.window_s,
        "runs": [],
    }
    for _ in range(args.repeats):
        results["runs"].append(measure_once(args.actors, args.window_s))
        print(results["runs"][-1], flush=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
