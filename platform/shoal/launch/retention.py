"""Keeping a run's best checkpoint next to Ray Train's latest K.

Ray Train keeps the latest `checkpoint.keep` checkpoints (and will not let anyone
else delete from its list). With `checkpoint.keep_best`, the driver copies each
checkpoint that beats the best score so far into RUN/best-checkpoint and records
it in RUN/best.json and in MLflow's tags.
"""

from __future__ import annotations

from typing import Any

from shoal.launch.storage import Storage

BEST_DIR, BEST_FILE = "best-checkpoint", "best.json"


class BestKeeper:
    def __init__(self, storage: Storage, run_name: str, metric: str, mode: str, set_tags: Any):
        self.storage, self.metric, self.mode, self.set_tags = storage, metric, mode, set_tags
        self.run_path, self.run_uri = storage.run_path(run_name), storage.run_uri(run_name)
        self.best = storage.read_json(f"{self.run_path}/{BEST_FILE}")  # survives driver restarts

    def offer(self, checkpoint_path: str, step: int, score: float | None) -> bool:
        """Keep this checkpoint if it is the best so far; True when it was kept."""
        if score is None or score != score:  # no score at this step, or NaN
            return False
        if self.best is not None:
            better = score < self.best["value"] if self.mode == "min" else score > self.best["value"]
            if not better:
                return False
        target = f"{self.run_path}/{BEST_DIR}"
        self.storage.replace_dir(_fs_path(checkpoint_path), target)
        self.best = {"metric": self.metric, "value": score, "step": step, "source": checkpoint_path}
        self.storage.write_json(f"{self.run_path}/{BEST_FILE}", self.best)
        self.set_tags(
            {
                "shoal.best_checkpoint": f"{self.run_uri}/{BEST_DIR}",
                "shoal.best_step": step,
                f"shoal.best_{self.metric.replace('/', '_')}": score,
            }
        )
        return True


def _fs_path(path: str) -> str:
    return path.split("://", 1)[1] if "://" in path else path
