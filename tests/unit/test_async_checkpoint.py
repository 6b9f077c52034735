"""Async checkpoints on the real Trainer and Engine (`LocalContext`, no cluster): one writer
at a time whatever `checkpoint.if_busy` says, and a background write that fails never
becomes a checkpoint anyone resumes from."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import pytest

from shoal.messages import checkpoint_phase_metric
from shoal.worker.checkpoint import format as checkpoint_format
from tests.unit.test_trainer import rows, trainer, workload

real_seal = checkpoint_format.seal


class SlowSeal:
    """Stands in for `format.seal` on the writer's thread: the write of `slow_step` is held
    until `release()` says so (or fails); counts how many seals ever ran at once, and notes
    the training step at which the held one finished."""

    def __init__(self, slow_step: int, release, position, fail: bool = False):
        self.slow_step, self.release, self.position, self.fail = slow_step, release, position, fail
        self.active = self.most_active = 0
        self.finished_at: int | None = None
        self.lock = threading.Lock()

    def __call__(self, directory: Path, rank: int) -> None:
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            step = checkpoint_format.json.loads((directory / checkpoint_format.TRAINER_STATE).read_text())
            if step["position"]["step"] == self.slow_step:
                deadline = time.monotonic() + 60
                while not self.release() and time.monotonic() < deadline:
                    time.sleep(0.01)
                if self.fail:
                    raise OSError(28, "No space left on device", str(directory))
                self.finished_at = self.position()
            real_seal(directory, rank)
        finally:
            with self.lock:
                self.active -= 1


def _run(tmp_path: Path, if_busy: str, monkeypatch: pytest.MonkeyPatch, release, slow_step=2, fail=False):
    w = workload(
        train={"max_steps": 8},
        checkpoint={"every_steps": 2, "async": True, "if_busy": if_busy, "keep": 10},
    )
    run, context = trainer(tmp_path, w, rows(200))
    seal = SlowSeal(slow_step, lambda: release(run), lambda: run.position.step, fail)
    monkeypatch.setattr(checkpoint_format, "seal", seal)
    return run, context, seal


def test_a_save_due_while_one_is_written_is_skipped_with_an_event(tmp_path, monkeypatch) -> None:
    run, context, seal = _run(tmp_path, "skip", monkeypatch, release=lambda run: run.position.step >= 5)
    run.run()
    saved = [int(r.checkpoint.rpartition("-")[2]) for r in context.reports if r.checkpoint]
    skipped = [(e["step"], e["writing_step"]) for e in context.events("checkpoint_skipped")]
    # 4 is due while 2 is held; 6 too if 2's manifest was still being written at step 6
    assert skipped[0] == (4, 2) and all(writing == 2 for _, writing in skipped)
    assert sorted(saved + [step for step, _ in skipped]) == [2, 4, 6, 8] and saved[-1] == 8
    assert seal.most_active == 1 and seal.finished_at >= 5  # training went on past step 4
    for step in saved:
        assert checkpoint_format.verify(tmp_path / "storage" / f"checkpoint-{step:08d}") is None


def test_a_save_due_while_one_is_written_waits_for_it(tmp_path, monkeypatch) -> None:
    release = lambda run: run.position.step >= 4  # noqa: E731 - the loop then waits at step 4's save
    run, context, seal = _run(tmp_path, "wait", monkeypatch, release=release)
    run.run()
    saved = [r.checkpoint for r in context.reports if r.checkpoint]
    assert saved == [f"checkpoint-{s:08d}" for s in (2, 4, 6, 8)]
    assert seal.most_active == 1 and not context.events("checkpoint_skipped")
    assert seal.finished_at == 4  # the loop stood at step 4 until the write of step 2 was sealed
    staged = [r["step"] for r in context.step_records() if checkpoint_phase_metric("staging") in r]
    assert staged == [3, 5, 7]  # each save's staging, in the record of the step after it (8: the last)


def test_a_background_write_that_fails_is_never_a_checkpoint(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the ranks write first
    (tmp_path / "tmp").mkdir()
    run, context, _ = _run(tmp_path, "wait", monkeypatch, release=lambda run: True, slow_step=4, fail=True)
    with pytest.raises(OSError, match="No space left"):
        run.run()
    assert [r.checkpoint for r in context.reports if r.checkpoint] == ["checkpoint-00000002"]
    assert sorted(p.name for p in (tmp_path / "storage").iterdir()) == ["checkpoint-00000002"]
    assert list((tmp_path / "tmp").iterdir()) == []  # the failed write's files are gone too
    monkeypatch.setattr(checkpoint_format, "seal", real_seal)
    latest = str(tmp_path / "storage" / "checkpoint-00000002")
    again, _ = trainer(tmp_path / "again", workload(train={"max_steps": 8}), rows(200), latest=latest)
    assert again.checkpointer.restore().source == latest and again.position.step == 2


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_that_fails_before_its_write_leaves_no_files(tmp_path, monkeypatch, asynchronous) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    checkpoint = {"every_steps": 2, "async": asynchronous, "keep": 10}
    run, context = trainer(tmp_path, workload(train={"max_steps": 8}, checkpoint=checkpoint), rows(200))
    real_states = checkpoint_format.states

    def states(parts, optimizers):
        if run.position.step == 4:
            raise MemoryError("no room to gather the state dict")
        return real_states(parts, optimizers)

    monkeypatch.setattr(checkpoint_format, "states", states)
    with pytest.raises(MemoryError, match="no room"):
        run.run()
    run.checkpointer.close()
    assert [r.checkpoint for r in context.reports if r.checkpoint] == ["checkpoint-00000002"]
    assert list((tmp_path / "tmp").iterdir()) == []  # step 4's directory went with its failure
