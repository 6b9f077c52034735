"""Checkpoint storage and the best-checkpoint keeper, on the local filesystem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shoal.launch.retention import BestKeeper
from shoal.launch.storage import RAY_CHECKPOINT_RECORD, StorageError, open_storage, probe


def test_local_and_s3_storage_are_told_apart(tmp_path: Path) -> None:
    local = open_storage(str(tmp_path / "runs"))
    assert not local.remote and local.run_uri("job") == f"{tmp_path}/runs/job"
    assert local.local_run_dir("job") == tmp_path / "runs" / "job"
    remote = open_storage("s3://bucket/some/prefix/", "http://127.0.0.1:9000")
    assert (
        remote.remote
        and remote.path == "bucket/some/prefix"
        and remote.run_uri("job") == "s3://bucket/some/prefix/job"
    )
    with pytest.raises(StorageError, match="neither a directory nor s3://"):
        open_storage("gs://bucket/x")


def test_probe_names_storage_that_cannot_be_written(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    storage = open_storage(str(tmp_path / "file" / "runs"))
    with pytest.raises(StorageError, match=f"cannot write to {tmp_path}/file/runs"):
        probe(storage)
    probe(open_storage(str(tmp_path / "fine")))
    assert (tmp_path / "fine").is_dir() and not list((tmp_path / "fine").iterdir())


def _checkpoint(root: Path, step: int) -> str:
    directory = root / "job" / f"checkpoint-{step:08d}"
    directory.mkdir(parents=True)
    (directory / "weights").write_text(str(step))
    return str(directory)


def test_best_keeper_copies_each_new_best_and_survives_restarts(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    tags: dict = {}
    keeper = BestKeeper(storage, "job", "val/loss", "min", tags.update)
    assert keeper.offer(_checkpoint(tmp_path, 10), 10, 2.0)
    assert keeper.offer(_checkpoint(tmp_path, 20), 20, 1.5)
    assert not keeper.offer(_checkpoint(tmp_path, 30), 30, 1.7)  # worse: the best stays at step 20
    assert not keeper.offer(_checkpoint(tmp_path, 40), 40, None)  # no score at this step
    assert (tmp_path / "job" / "best-checkpoint" / "weights").read_text() == "20"
    assert json.loads((tmp_path / "job" / "best.json").read_text())["step"] == 20
    assert tags["shoal.best_step"] == 20 and tags["shoal.best_val_loss"] == 1.5
    assert tags["shoal.best_checkpoint"] == f"{tmp_path}/job/best-checkpoint"

    again = BestKeeper(storage, "job", "val/loss", "min", tags.update)  # a new driver
    assert not again.offer(_checkpoint(tmp_path, 50), 50, 1.6)
    assert again.offer(_checkpoint(tmp_path, 60), 60, 1.2)
    assert (tmp_path / "job" / "best-checkpoint" / "weights").read_text() == "60"
    accuracy = BestKeeper(storage, "acc", "val/accuracy", "max", tags.update)
    (tmp_path / "acc").mkdir()
    assert accuracy.offer(_checkpoint(tmp_path, 70), 70, 0.9) and not accuracy.offer(
        _checkpoint(tmp_path, 80), 80, 0.8
    )


def test_a_checkpoint_record_cut_short_is_set_aside_and_the_newest_checkpoint_named(tmp_path: Path) -> None:
    """A full disk cut Ray Train's record of the checkpoints short: Ray's controller would not
    start; shoal moves it aside and names the newest checkpoint for the workers to restore."""
    storage = open_storage(str(tmp_path))
    run = tmp_path / "r"
    for step in (20, 40, 60):
        (run / f"checkpoint-{step:08d}").mkdir(parents=True)
    assert storage.set_aside_unreadable_record("r") is None  # no record yet
    record = run / RAY_CHECKPOINT_RECORD
    record.write_text(json.dumps({"checkpoints": ["checkpoint-00000060"]}))
    assert storage.set_aside_unreadable_record("r") is None and record.exists()  # a sound one stays
    record.write_text('{"checkpoints": ["checkpoint-000')
    assert storage.set_aside_unreadable_record("r") == f"{run}/checkpoint-00000060"
    assert not record.exists() and (run / f"{RAY_CHECKPOINT_RECORD}.unreadable").exists()
    record.write_bytes(b'{"name": "\xe2\x82')  # cut inside a character
    assert storage.set_aside_unreadable_record("r") == f"{run}/checkpoint-00000060"
    # the attempt after the set-aside failed before Ray wrote a record of its own: still the newest
    assert not record.exists() and storage.set_aside_unreadable_record("r") == f"{run}/checkpoint-00000060"


def test_a_lost_record_resumes_from_the_newest_checkpoint_that_leaves_mlflow_no_gap(tmp_path: Path) -> None:
    """Each checkpoint carries the steps since the one before it; a run whose MLflow has steps
    up to 23 resumes from 40 (steps 21-40 travel with it), not from 60 (41-60 only)."""
    storage, run = open_storage(str(tmp_path)), tmp_path / "r"
    for step in (20, 40, 60):
        (run / f"checkpoint-{step:08d}").mkdir(parents=True)
        recent = {"steps": [{"step": s, "time": 0.0} for s in range(step - 19, step + 1)], "evals": []}
        state = {"position": {"step": step}, "recent": recent}
        (run / f"checkpoint-{step:08d}" / "trainer_state.json").write_text(json.dumps(state))
    (run / "checkpoint-00000080").mkdir()  # the full disk stopped it before its trainer state
    assert storage.newest_logged_through("r", logged_until=23) == f"{run}/checkpoint-00000040"
    assert storage.newest_logged_through("r", logged_until=40) == f"{run}/checkpoint-00000060"
    assert storage.newest_logged_through("r", logged_until=60) == f"{run}/checkpoint-00000060"
    assert storage.newest_logged_through("r", logged_until=5) == f"{run}/checkpoint-00000020"
    (run / "checkpoint-00000020" / "trainer_state.json").write_text('{"position": {"st')
    assert storage.newest_logged_through("r", logged_until=5) == f"{run}/checkpoint-00000040"
    assert storage.newest_logged_through("s", logged_until=5) is None
