"""What the driver hands every worker: the validated workload, typed, and the run's facts."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.spec.schema import Workload


@dataclass(frozen=True)
class WorkerConfig:
    workload: Workload
    task: str  # classify | lm | custom: how batches become a loss (models/objective.py)
    run_dir: str  # this run's local directory (logs, pid files, audit, compile cache)
    report_interval_s: float
    threads_per_worker: int
    train_manifest: str = ""  # the training data's manifest, as JSON (data/manifest.py)
    val_manifest: str = ""  # the validation set's, or "" without one (data/evaluation.py)
    keep_val: bool = False  # keep this rank's validation batches in memory between evaluations
    sys_path: tuple[str, ...] = field(default_factory=tuple)  # where user model modules live
    audit_samples: bool = False  # write the sample ids of every step (exactly-once tests)
    init_from: str | None = None  # another run's checkpoint, for a run that has none of its own
    # This run's newest checkpoint, when Ray Train's record of them was unreadable and set aside.
    own_latest: str | None = None

    def as_train_loop_config(self) -> dict[str, WorkerConfig]:
        """Ray Train wants a dict for `train_loop_config`."""
        return {"worker": self}

    @staticmethod
    def from_train_loop_config(config: dict[str, WorkerConfig]) -> WorkerConfig:
        return config["worker"]
