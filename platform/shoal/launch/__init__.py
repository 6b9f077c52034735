"""Driver side: turning a workload into a Ray Train job."""

from shoal.launch.cluster import ClusterError
from shoal.launch.run import RunOptions, RunResult, run

__all__ = ["ClusterError", "RunOptions", "RunResult", "run"]
