"""The trainer's own state: what a checkpoint brings back besides weights, optimizer
state, the learning-rate schedule and RNG (torchtitan's TrainState).

It is plain data (`state_dict()` is JSON), written by rank 0 into
`trainer_state.json` (see `format.py`) and loaded by every rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shoal.data.manifest import check_resume
from shoal.errors import ShoalError
from shoal.messages import RecentRecords


@dataclass
class Position:
    """Where training stands: optimizer steps done and the data read so far."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # global micro-batches consumed in `epoch` (the same at any world size)
    samples: int = 0  # training samples consumed, all ranks together


class GlobalBatchChanged(ShoalError, ValueError):
    """A checkpoint trained with another global batch: its data position means other samples."""


@dataclass
class TrainingState:
    world_size: int
    global_batch: int
    data_digest: str = ""  # the training data's manifest digest (data/manifest.py)
    accept_changed_data: bool = False  # data.accept_changed_data: resume on other data anyway
    position: Position = field(default_factory=Position)
    skipped_steps: set[tuple[int, int]] = field(default_factory=set)  # (epoch, step in epoch) left out
    nan_steps: int = 0
    recent: RecentRecords = field(default_factory=RecentRecords)  # since the last checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {
            "position": asdict(self.position),
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "data_digest": self.data_digest,
            "skipped_steps": sorted(self.skipped_steps),
            "nan_steps": self.nan_steps,
            "recent": self.recent.to_dict(),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> int:
        """Continue from a checkpoint's state; returns the world size it was written at.

        Skipped steps and the NaN count only grow (an in-process rollback keeps what it
        learned since the checkpoint); the world size stays this attempt's. A checkpoint of
        another global batch, or of other data (unless accepted), raises a ShoalError: its
        data position would mean other rows.
        """
        if saved["global_batch"] != self.global_batch:
            raise GlobalBatchChanged(
                f"the checkpoint was trained with a global batch of {saved['global_batch']} rows, "
                f"this workload asks for {self.global_batch}"
            )
        recorded = saved.get("data_digest", "")  # absent from checkpoints written before manifests
        if recorded and self.data_digest:
            check_resume(recorded, self.data_digest, self.accept_changed_data)
        self.position = Position(**saved["position"])
        self.skipped_steps |= {(int(epoch), int(step)) for epoch, step in saved["skipped_steps"]}
        self.nan_steps = max(self.nan_steps, saved["nan_steps"])
        self.recent = RecentRecords.from_dict(saved["recent"])
        return saved["world_size"]

    def checkpointed(self) -> None:
        """The recent records are in a checkpoint now."""
        self.recent = RecentRecords()
