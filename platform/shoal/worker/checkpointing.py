"""A worker's checkpoints through Ray Train: save (sync or async), commit, restore with fallback.

Each rank writes its shard into a local temporary directory, seals it with a
manifest, and hands it to `ray.train.report`, which copies every rank's files
into one checkpoint directory in storage and commits it. Restoring verifies the
manifests: a checkpoint that is incomplete or corrupt is passed over for the
newest intact one before it, and the rejection is reported as an event.

An async save snapshots the state and writes it on a thread of its own, over a
process group of its own (DCP on the training group would interleave with the
training collectives and hang). Training goes on; the checkpoint is reported at
the first step at which every rank's write has finished.
"""

from __future__ import annotations

import shutil
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from shoal.worker import checkpoint
from shoal.worker.engine import Engine
from shoal.worker.reporting import Reporter


@dataclass
class PendingSave:
    directory: Path
    future: Future | None
    summary: dict[str, Any]
    name: str


@dataclass
class Restored:
    state: dict[str, Any]
    rng_restored: bool
    source: str


class Checkpointer:
    def __init__(
        self, engine: Engine, rank: int, background: bool, reporter: Reporter, init_from: str | None = None
    ):
        self.engine, self.rank, self.reporter = engine, rank, reporter
        self.init_from = init_from  # another run's checkpoint, for a run that has none of its own
        self.group = dist.new_group(backend="gloo") if background and dist.is_initialized() else None
        self.background = background
        self.pending: PendingSave | None = None

    # -- saving -----------------------------------------------------------------------
    def save(self, name: str, trainer_state: dict[str, Any], summary: dict[str, Any]) -> None:
        """Start a checkpoint; a synchronous one is reported before this returns."""
        self.finish_pending()
        directory = Path(tempfile.mkdtemp(prefix="shoal-ckpt-"))
        state = trainer_state if self.rank == 0 else None
        future = checkpoint.save(
            directory,
            self.engine.parts,
            self.engine.optimizers,
            self.rank,
            state,
            process_group=self.group,
        )
        self.pending = PendingSave(directory, future, summary, name)
        if future is None:
            self.finish_pending()

    def written_here(self) -> bool:
        """Has this rank's part of the pending checkpoint reached its temporary directory?"""
        return self.pending is None or self.pending.future is None or self.pending.future.done()

    def finish_pending(self, extra: dict[str, Any] | None = None) -> None:
        """Wait for the pending write (if any), seal it and report it. Every rank calls this
        at the same step: `ray.train.report` is collective."""
        import ray.train

        pending, self.pending = self.pending, None
        if pending is None:
            return
        handed_over = False
        try:
            if pending.future is not None:
                pending.future.result()
                checkpoint.seal(pending.directory, self.rank)
            self.reporter.send(
                {**pending.summary, **(extra or {}), "checkpointed": True},
                checkpoint=ray.train.Checkpoint.from_directory(str(pending.directory)),
                checkpoint_dir_name=pending.name,
                upload_in_background=self.background,
            )
            handed_over = self.background  # Ray deletes the directory after its upload
        finally:
            if not handed_over:
                shutil.rmtree(pending.directory, ignore_errors=True)

    # -- restoring --------------------------------------------------------------------
    def restore(self) -> Restored | None:
        """Load the newest intact checkpoint of this run (else `init_from`), or None for a fresh start."""
        import ray.train

        latest = ray.train.get_checkpoint()
        if latest is None and self.init_from:
            latest = ray.train.Checkpoint(self.init_from)
        if latest is None:
            return None
        for candidate in [latest, *older_checkpoints(latest)]:
            with candidate.as_directory() as directory:
                problem = self._verified_by_rank0(Path(directory))
                if problem is None:
                    state, rng = checkpoint.restore(
                        Path(directory),
                        self.engine.parts,
                        self.engine.optimizers,
                        self.engine.schedulers,
                        self.rank,
                    )
                    return Restored(state, rng, candidate.path)
            self.reporter.event("checkpoint_rejected", checkpoint=candidate.path, reason=problem)
        parent = Path(latest.path).parent
        raise RuntimeError(f"no intact checkpoint in {parent}: every one failed verification")

    def _verified_by_rank0(self, directory: Path) -> str | None:
        """`checkpoint.verify` reads every file of the checkpoint: rank 0 does it for all."""
        verdict = [checkpoint.verify(directory) if self.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(verdict, src=0)
        return verdict[0]


def older_checkpoints(latest: Any) -> list[Any]:
    """The run's checkpoints older than `latest`, newest first (same filesystem)."""
    import ray.train

    parent, own = str(Path(latest.path).parent), Path(latest.path).name
    steps = checkpoint.checkpoint_steps(latest.filesystem, parent)
    newest = steps.get(own)
    older = [n for n, step in steps.items() if n != own and (newest is None or step < newest)]
    older.sort(key=steps.get, reverse=True)
    return [ray.train.Checkpoint(f"{parent}/{n}", filesystem=latest.filesystem) for n in older]
