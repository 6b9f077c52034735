"""Per-process setup of a training worker: threads, device, seeds, watchdog, pid file, audit."""

from __future__ import annotations

import faulthandler
import json
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np
import torch
import torch.distributed as dist


def pick_device(local_rank: int) -> torch.device:
    """CUDA when this process can see a GPU, else CPU; never a user flag to get wrong."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def write_pid_file(run_dir: str, rank: int, attempt_id: str) -> None:
    """Who is rank N right now: lets people (and fault tests) find a worker's process."""
    directory = Path(run_dir) / "workers"
    directory.mkdir(parents=True, exist_ok=True)
    record = {"pid": os.getpid(), "rank": rank, "host": socket.gethostname(), "attempt": attempt_id}
    tmp = directory / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(directory / f"rank{rank}.json")


class HangWatchdog:
    """If no step completes within `timeout_s`, dump every thread's stack and exit.

    The exit fails the attempt, so Ray Train restarts the workers from the latest
    checkpoint instead of leaving a rank blocked in a collective forever.

    faulthandler's countdown runs on a thread of its own that each arming stops and starts
    again (about 0.3 ms, a few percent of a small model's step), so the countdown is set a
    tenth longer and restarted only once a tenth of it has passed: a hang is caught between
    `timeout_s` and 1.1 x `timeout_s` after the last step.
    """

    SLACK = 0.1

    def __init__(self, timeout_s: float, run_dir: str, rank: int):
        self.timeout_s = timeout_s
        self.armed_at: float | None = None
        log_dir = Path(run_dir) / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(log_dir / f"hang-rank{rank}.txt", "a")  # noqa: SIM115 (lives with the process)
        self._file.write(
            f"# pid {os.getpid()} started {time.strftime('%Y-%m-%d %H:%M:%S')}; "
            f"stacks follow if no step completes within {timeout_s:g} s\n"
        )
        self._file.flush()

    def arm(self) -> None:
        """Progress: (re)start the countdown when due; called after every step."""
        now = time.monotonic()
        if self.armed_at is not None and now - self.armed_at < self.SLACK * self.timeout_s:
            return
        self.armed_at = now
        faulthandler.dump_traceback_later(self.timeout_s * (1 + self.SLACK), exit=True, file=self._file)

    def disarm(self) -> None:
        self.armed_at = None
        faulthandler.cancel_dump_traceback_later()


class SampleAudit:
    """Which sample ids each applied optimizer step trained on, per rank and attempt.

    Written to RUN_DIR/audit/rankN.jsonl when SHOAL_AUDIT_SAMPLES=1; a step that a
    restart replays appears again under the later attempt, which is the one that
    counts. The fault tests check exactly-once data with it.
    """

    def __init__(self, run_dir: str, rank: int):
        directory = Path(run_dir) / "audit"
        directory.mkdir(parents=True, exist_ok=True)
        self.attempt = _shared_attempt_id()
        self._file: IO[str] = open(directory / f"rank{rank}.jsonl", "a")  # noqa: SIM115 (lives with the process)
        self._evals: IO[str] = open(directory / f"eval-rank{rank}.jsonl", "a")  # noqa: SIM115

    def new_lineage(self) -> None:
        """After an in-process rollback: the steps replayed from here replace the earlier ones."""
        self.attempt = _shared_attempt_id()

    def record(self, step: int, epoch: int, group: list) -> None:
        """`group`: the step's stream items on this rank (epoch, global micro-batch index, batch)."""
        micro = {
            str(item.index): [int(i) for i in item.batch["id"].tolist()]
            for item in group
            if "id" in item.batch
        }
        ids = [i for batch in micro.values() for i in batch]
        line = {
            "attempt": self.attempt,
            "step": step,
            "epoch": epoch,
            "ids": ids,
            "micro": micro,
            "time": time.time(),
        }
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def evaluated(self, step: int, batches: Iterator[dict], slot: int, slots: int) -> Iterator[dict]:
        """Pass an evaluation's batches through, then write the sample ids they held (to
        audit/eval-rankN.jsonl; one rank per data-parallel slot writes)."""
        ids: list[int] = []
        for batch in batches:
            ids += [int(i) for i in batch["id"].tolist()] if "id" in batch else []
            yield batch
        line = {"attempt": self.attempt, "step": step, "slot": slot, "slots": slots, "ids": ids}
        self._evals.write(json.dumps(line) + "\n")
        self._evals.flush()


def _shared_attempt_id() -> str:
    """One id for every rank of this attempt: rank 0's start time, broadcast."""
    chosen = [f"{time.time():.6f}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]
