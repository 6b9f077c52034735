"""shoal on a simulated multi-node Ray cluster: `python bench/multinode.py --precision fp32`.

Three Ray nodes on this machine (`ray.cluster_utils.Cluster`): a head with no
CPUs (the driver's side: Train controller, report queue, data coordinator) and
two worker nodes with one CPU each, so each training worker gets a node of its
own. Compared with the same run on one node, what changes is the control plane
(three raylets, cross-node object transfers, remote actor calls), not the work.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shoal.launch.cluster import lean_ray_env

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def three_node_cluster() -> Iterator[str]:
    """A head without CPUs and two 1-CPU worker nodes; yields the address to attach to."""
    from ray.cluster_utils import Cluster

    lean = lean_ray_env()  # as on the one-node Ray that `shoal run` starts itself
    os.environ.update(lean)  # inherited by every node's processes
    cluster = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()
        for key in lean:
            os.environ.pop(key, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    shoal = Path(sys.executable).parent / "shoal"
    with three_node_cluster() as address:
        command = [str(shoal), "run", str(REPO / "bench" / "gpt_bench.yaml"), "--address", address]
        command += ["--set", f"train.precision={args.precision}", "--set", f"train.max_steps={args.steps}"]
        raise SystemExit(subprocess.call(command))


if __name__ == "__main__":
    main()
