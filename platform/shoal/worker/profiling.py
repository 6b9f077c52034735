"""`monitor.profile: {start_step, steps}`: a torch.profiler trace of a window of steps on
every rank, gzipped, sent to the driver (which logs it to MLflow and TensorBoard).

The trace travels in a report, base64-encoded, so that it reaches MLflow from any
node; a trace too big for that stays in the run directory and the driver is told
where.
"""

from __future__ import annotations

import base64
import gzip
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from shoal.spec.schema import ProfileSpec

MAX_SENT_BYTES = 32 * 2**20


class ProfileWindow:
    def __init__(self, window: ProfileSpec | None, rank: int, device: torch.device, run_dir: str):
        self.window, self.rank, self.device = window, rank, device
        self.directory = Path(run_dir) / "profiles"
        self.profiler: Any = None
        self.label: Any = None

    def _first_and_last(self) -> tuple[int, int]:
        assert self.window is not None
        first = self.window.start_step
        return first, first + self.window.steps - 1

    def before_step(self, step: int) -> None:
        """`step` is the optimizer step about to run (1-based)."""
        if self.window is None:
            return
        if self.profiler is None and step == self._first_and_last()[0]:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self.profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
            self.profiler.start()
        if self.profiler is not None:  # the step's span, named as TensorBoard's profiler plugin expects
            self.label = record_function(f"ProfilerStep#{step}")
            self.label.__enter__()

    def after_step(self, step: int) -> dict[str, Any] | None:
        """The finished trace once `step` closes the window, else None."""
        if self.profiler is None:
            return None
        self.label.__exit__(None, None, None)
        first, last = self._first_and_last()
        if step < last:
            return None
        self.profiler.stop()
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}.steps{first}-{last}.pt.trace.json"
        raw = self.directory / name
        self.profiler.export_chrome_trace(str(raw))
        packed = gzip.compress(raw.read_bytes())
        raw.unlink()
        (self.directory / f"{name}.gz").write_bytes(packed)
        self.profiler = None
        trace = {"rank": self.rank, "name": f"{name}.gz", "first_step": first, "last_step": last}
        if len(packed) <= MAX_SENT_BYTES:
            trace["data"] = base64.b64encode(packed).decode()
        else:
            trace["path"] = str(self.directory / f"{name}.gz")
        return trace
