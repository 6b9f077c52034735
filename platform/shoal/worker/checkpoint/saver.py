"""The saver: when to checkpoint, writing (sync or async), committing, restoring with fallback.

Each rank writes its shard into a local temporary directory (`format.py`), seals
it with a manifest, and hands it to the context's `report`, which copies every
rank's files into one checkpoint directory in storage and commits it. Restoring
verifies the manifests: a checkpoint that is incomplete or corrupt is passed
over for the newest intact one before it, and the rejection is reported as an
event.

What a checkpoint holds is assembled here, in one place: the engine's model and
optimizer parts and schedule, the trainer's `TrainingState`, every rank's RNG.

An async save stages the state on the training thread and writes and seals it in the
background (`writer.py`); the checkpoint is reported at the first step at which every
rank's write has finished. A save due while one is in flight waits for it or is skipped
(`checkpoint.if_busy`). Each step's record carries the seconds saving held the training
thread, by phase (`time/checkpoint/<phase>_s`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shoal.messages import EventKind, ReportSummary
from shoal.spec.schema import CheckpointSpec
from shoal.worker.checkpoint import format as checkpoint_format
from shoal.worker.checkpoint.state import TrainingState
from shoal.worker.checkpoint.writer import BackgroundWriter
from shoal.worker.context import StoredCheckpoint, TrainContext
from shoal.worker.engine import Engine
from shoal.worker.reporting import Reporter


@dataclass
class PendingSave:
    directory: Path
    future: Future | None
    summary: ReportSummary
    name: str
    step: int
    phases: dict[str, float]  # seconds the training thread spent on it, by phase


@dataclass
class Restored:
    source: str  # the checkpoint's path in storage
    rng_restored: bool  # False on a rank that did not exist when it was written
    previous_world: int  # the world size it was written at
    from_init: bool  # it is `init_from`'s (another run's), not this run's own


class Checkpointer:
    def __init__(
        self,
        engine: Engine,
        training: TrainingState,
        context: TrainContext,
        reporter: Reporter,
        settings: CheckpointSpec,
        init_from: str | None = None,
        own_latest: str | None = None,
    ):
        self.engine, self.training, self.context, self.reporter = engine, training, context, reporter
        self.rank = context.world_rank
        self.every_steps, self.background = settings.every_steps, settings.async_
        self.init_from = init_from  # another run's checkpoint, for a run that has none of its own
        self.own_latest = own_latest  # this run's newest, when Ray Train lost its record of them
        self.if_busy = settings.if_busy
        self.writer = BackgroundWriter(engine.device) if self.background else None
        self.pending: PendingSave | None = None
        self.saved_step = -1
        self.blocked: dict[str, float] = {}  # the training thread's seconds saving, by phase

    # -- saving -----------------------------------------------------------------------
    def due(self, step: int, last: bool) -> bool:
        """Whether to checkpoint now: after every `checkpoint.every_steps`-th step and the last."""
        return last or bool(self.every_steps and step % self.every_steps == 0)

    def save(self, summary: ReportSummary, final: bool = False) -> None:
        """Checkpoint the current step (a synchronous one is reported before this returns);
        with nothing new since the last checkpoint, only report the summary."""
        step = self.training.position.step
        if step == self.saved_step:
            self.finish_pending()
            with self._timed({}, "report"):
                self.reporter.send(summary)
            return
        if self.pending is not None and self.if_busy == "skip" and not final:
            self.reporter.event(EventKind.CHECKPOINT_SKIPPED, step=step, writing_step=self.pending.step)
            with self._timed({}, "report"):
                self.reporter.send(summary)
            return
        self.saved_step = step
        self.finish_pending()  # if_busy "wait": the write in flight is waited for, then reported
        directory = Path(tempfile.mkdtemp(prefix="shoal-ckpt-"))
        phases: dict[str, float] = {}
        try:
            future = self._write(directory, phases)
        except BaseException:  # not pending yet: nothing else would remove its files
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self.pending = PendingSave(
            directory, future, summary, checkpoint_format.checkpoint_name(step), step, phases
        )
        self.training.checkpointed()
        if future is None or final:
            self.finish_pending()

    def _write(self, directory: Path, phases: dict[str, float]) -> Future | None:
        """This rank's part of the checkpoint into `directory`: written and sealed, or handed
        to the background writer (its future)."""
        with self._timed(phases, "extras"):
            trainer_state = self._trainer_state() if self.rank == 0 else None
            checkpoint_format.write_extras(directory, self.rank, trainer_state)
        with self._timed(phases, "state_dict"):
            states = checkpoint_format.states(self.engine.parts, self.engine.optimizers)
        if self.writer is not None:
            with self._timed(phases, "staging"):
                return self.writer.write(states, directory, self.rank)
        with self._timed(phases, "write"):
            dcp.save(states, checkpoint_id=str(directory))
        with self._timed(phases, "seal"):
            checkpoint_format.seal(directory, self.rank)
        return None

    @contextmanager
    def _timed(self, phases: dict[str, float], name: str) -> Iterator[None]:
        """Time a phase of a save that holds the training thread."""
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - started
            phases[name] = phases.get(name, 0.0) + seconds
            self.blocked[name] = self.blocked.get(name, 0.0) + seconds

    def close(self) -> None:
        """Release the background writer's thread and buffers (after the last save)."""
        if self.writer is not None:
            self.writer.close()

    def take_blocked(self) -> dict[str, float]:
        """Seconds the training thread spent saving since the last call, by phase."""
        blocked, self.blocked = self.blocked, {}
        return blocked

    def _trainer_state(self) -> dict[str, Any]:
        return {**self.training.state_dict(), "scheduler": self.engine.schedulers[0].state_dict()}

    def written_here(self) -> bool:
        """Has this rank's part of the pending checkpoint reached its temporary directory?"""
        return self.pending is None or self.pending.future is None or self.pending.future.done()

    def finish_pending(self) -> None:
        """Wait for the pending write (if any), seal it and report it. Every rank calls this
        at the same step: reporting is collective."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        handed_over, phases = False, pending.phases
        try:
            if pending.future is not None:
                with self._timed(phases, "wait"):
                    pending.future.result()  # written and sealed
            with self._timed(phases, "report"):
                self.reporter.send(
                    replace(pending.summary, checkpointed=True),
                    checkpoint_dir=pending.directory,
                    checkpoint_name=pending.name,
                    upload_in_background=self.background,
                )
            handed_over = self.background  # the upload deletes the directory when done
        finally:
            if not handed_over:
                shutil.rmtree(pending.directory, ignore_errors=True)

    # -- restoring --------------------------------------------------------------------
    def restore(self) -> Restored | None:
        """Load the newest intact checkpoint of this run (else `init_from`) into the engine and
        the training state, or None for a fresh start."""
        latest = self.context.latest_checkpoint()
        if latest is None and self.own_latest:
            latest = self.context.checkpoint_at(self.own_latest)
        if latest is None and self.init_from:
            latest = self.context.checkpoint_at(self.init_from)
        if latest is None:
            return None
        for candidate in [latest, *self._older_than(latest)]:
            with candidate.as_directory() as directory:
                problem = self._verified_by_rank0(Path(directory))
                if problem is None:
                    return self._load(Path(directory), candidate.path)
            self.reporter.event(EventKind.CHECKPOINT_REJECTED, checkpoint=candidate.path, reason=problem)
        parent = Path(latest.path).parent
        raise RuntimeError(f"no intact checkpoint in {parent}: every one failed verification")

    def _load(self, directory: Path, source: str) -> Restored:
        e = self.engine
        saved, rng = checkpoint_format.restore(directory, e.parts, e.optimizers, e.schedulers, self.rank)
        previous_world = self.training.load_state_dict(saved)
        self.saved_step = self.training.position.step
        return Restored(source, rng, previous_world, from_init=source == self.init_from)

    def _verified_by_rank0(self, directory: Path) -> str | None:
        """`checkpoint_format.verify` reads every file of the checkpoint: rank 0 does it for all."""
        verdict = [checkpoint_format.verify(directory) if self.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(verdict, src=0)
        return verdict[0]

    def _older_than(self, latest: StoredCheckpoint) -> list[StoredCheckpoint]:
        """The run's checkpoints older than `latest`, newest first (same filesystem)."""
        parent, own = str(Path(latest.path).parent), Path(latest.path).name
        steps = checkpoint_format.checkpoint_steps(latest.filesystem, parent)
        newest = steps.get(own)
        older = [n for n, step in steps.items() if n != own and (newest is None or step < newest)]
        older.sort(key=steps.get, reverse=True)
        return [self.context.checkpoint_at(f"{parent}/{n}", latest.filesystem) for n in older]
