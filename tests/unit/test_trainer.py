"""The Trainer's decisions without a cluster: checkpoint and report cadence, NaN skip and
rollback, and the arithmetic of a resize, on the real Engine through `LocalContext`."""

from __future__ import annotations

import faulthandler
import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shoal.spec.schema import Workload
from shoal.worker.checkpoint import format as checkpoint_format
from shoal.worker.config import WorkerConfig
from shoal.worker.loop import Trainer
from tests.unit.local_context import LocalContext, parquet_manifest
from tests.unit.parallel_harness import free_port

MICRO = 8


@pytest.fixture(autouse=True)
def no_armed_watchdog() -> Iterator[None]:
    """A test that fails mid-run leaves the hang watchdog armed: it would end pytest later."""
    yield
    faulthandler.cancel_dump_traceback_later()


def rows(count: int, nan_steps: tuple[int, ...] = (), seed: int = 0) -> dict[str, torch.Tensor]:
    """`count` rows of a 10-class problem; the rows of the given global steps hold NaN."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, 16, generator=generator)
    for step in nan_steps:
        x[step * MICRO : (step + 1) * MICRO] = float("nan")
    return {"x": x, "y": torch.randint(0, 10, (count,), generator=generator), "id": torch.arange(count)}


def workload(**sections: dict[str, Any]) -> Workload:
    spec: dict[str, Any] = {
        "name": "trainer-unit",
        "model": {"family": "mlp", "args": {"in_features": 16, "hidden": 8, "layers": 1}},
        "data": {"train": {"path": "in-memory"}, "batch_size": MICRO, "shuffle_buffer": 0},
        "train": {"max_steps": 5, "optimizer": {"lr": 0.01}},
    }
    for name, values in sections.items():
        spec[name] = {**spec.get(name, {}), **values}
    return Workload.model_validate(spec)


def trainer(
    tmp_path: Path,
    w: Workload,
    data: dict[str, torch.Tensor],
    report_interval_s: float = 1e9,
    audit: bool = False,
    latest: str | None = None,
    own_latest: str | None = None,
) -> tuple[Trainer, LocalContext]:
    (tmp_path / "storage").mkdir(parents=True, exist_ok=True)
    context = LocalContext(tmp_path / "storage", latest=latest)
    config = WorkerConfig(
        workload=w,
        task="classify",
        run_dir=str(tmp_path / "run"),
        report_interval_s=report_interval_s,
        threads_per_worker=1,
        train_manifest=parquet_manifest(tmp_path / "data", data),
        audit_samples=audit,
        own_latest=own_latest,
    )
    return Trainer(config, context), context


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.engine.parts[0].state_dict().items()}


def test_checkpoints_every_n_steps_and_at_the_end(tmp_path: Path) -> None:
    t, context = trainer(tmp_path, workload(train={"max_steps": 7}, checkpoint={"every_steps": 3}), rows(80))
    t.run()
    assert [r.checkpoint for r in context.reports] == [
        None,  # the attempt's start
        "checkpoint-00000003",
        "checkpoint-00000006",
        "checkpoint-00000007",
    ]
    assert [r.metrics["step"] for r in context.reports] == [0, 3, 6, 7]
    assert context.reports[-1].metrics["final"] is True
    assert [int(r["step"]) for r in context.step_records()] == [1, 2, 3, 4, 5, 6, 7]  # each once
    for name in ("checkpoint-00000003", "checkpoint-00000006", "checkpoint-00000007"):
        directory = tmp_path / "storage" / name
        assert checkpoint_format.verify(directory) is None
        state = json.loads((directory / checkpoint_format.TRAINER_STATE).read_text())
        assert state["position"]["step"] == int(name[-8:])
        assert state["position"]["samples"] == int(name[-8:]) * MICRO
    # What was recorded since the previous checkpoint travels in the next one.
    state = json.loads((tmp_path / "storage" / "checkpoint-00000006" / "trainer_state.json").read_text())
    assert [int(r["step"]) for r in state["recent"]["steps"]] == [4, 5, 6]


def test_without_ray_trains_record_the_run_resumes_from_its_newest_intact_checkpoint(tmp_path: Path) -> None:
    """Ray Train's record of the checkpoints was set aside (a full disk cut it short): the
    driver names the newest one; one that is only partly written is passed over."""
    data = rows(80)
    t, _ = trainer(tmp_path, workload(train={"max_steps": 4}, checkpoint={"every_steps": 2}), data)
    t.run()
    storage = tmp_path / "storage"
    (storage / "checkpoint-00000004" / checkpoint_format.TRAINER_STATE).unlink()  # half written
    w = workload(train={"max_steps": 6}, checkpoint={"every_steps": 2})
    t, context = trainer(tmp_path, w, data, own_latest=str(storage / "checkpoint-00000004"))
    t.run()
    (start,) = context.events("attempt_started")
    assert start["restored_step"] == 2 and context.events("checkpoint_rejected")
    # steps 1-2 travel again with checkpoint 2 (the driver logs only what it has not); 3-6 trained
    assert [int(r["step"]) for r in context.step_records()] == [1, 2, 3, 4, 5, 6]
    assert t.position.step == 6 and t.position.samples == 6 * MICRO


def test_a_report_interval_of_zero_reports_every_step(tmp_path: Path) -> None:
    t, context = trainer(tmp_path, workload(train={"max_steps": 4}), rows(64), report_interval_s=0.0)
    t.run()
    assert [r.metrics["step"] for r in context.reports] == [0, 1, 2, 3, 4]
    assert [len(r.metrics["shoal_steps"]) for r in context.reports] == [0, 1, 1, 1, 1]
    assert [r.checkpoint for r in context.reports] == [None, None, None, None, "checkpoint-00000004"]


def test_nan_skip_drops_that_step_and_trains_on(tmp_path: Path) -> None:
    w = workload(train={"max_steps": 5}, failure={"on_nan": "skip"})
    t, context = trainer(tmp_path, w, rows(64, nan_steps=(2,)))
    t.run()
    (skip,) = context.events("nan_skip")
    assert (skip["step"], skip["epoch"], skip["step_in_epoch"]) == (3, 0, 2)
    records = context.step_records()
    assert [int(r["step"]) for r in records] == [1, 2, 3, 4, 5]
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in records)
    assert t.position.step == 5 and t.position.samples == 6 * MICRO  # the skipped rows were read
    assert all(torch.isfinite(v).all() for v in weights(t).values())


def test_too_many_nan_steps_fail_the_run(tmp_path: Path) -> None:
    w = workload(train={"max_steps": 5}, failure={"on_nan": "skip", "max_nan_steps": 1})
    t, context = trainer(tmp_path, w, rows(64, nan_steps=(1, 3)))
    t.run()
    (fatal,) = context.events("fatal")
    assert "more than failure.max_nan_steps (1)" in fatal["reason"]
    assert context.reports[-1].metrics["fatal"] == fatal["reason"]
    assert t.position.step == 2  # steps 1 and 3 trained; the second NaN (step 5) ended it


def test_nan_rollback_resumes_from_the_checkpoint_without_that_batch(tmp_path: Path) -> None:
    """Rolled back to step 2 and leaving global step 3's rows out, the run ends with the
    weights of a run that never saw those rows, bit for bit."""
    w = workload(train={"max_steps": 5}, checkpoint={"every_steps": 2}, failure={"on_nan": "rollback"})
    data = rows(64, nan_steps=(3,))
    t, context = trainer(tmp_path / "rollback", w, data)
    t.run()
    (nan,) = context.events("nan_rollback")
    assert (nan["step"], nan["step_in_epoch"]) == (4, 3)
    (rolled_back,) = context.events("rolled_back")
    assert rolled_back["restored_step"] == 2
    assert t.position.step == 5 and t.training.skipped_steps == {(0, 3)}

    kept = torch.cat([torch.arange(0, 3 * MICRO), torch.arange(4 * MICRO, 64)])
    clean, _ = trainer(tmp_path / "clean", w, {k: v[kept] for k, v in data.items()})
    clean.run()
    for name, value in weights(clean).items():
        assert torch.equal(weights(t)[name], value), name


def _two_rank_attempt(rank: int, port: int, tmp_path: Path, spec: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    context = LocalContext(tmp_path / "storage", rank, 2)
    manifest = parquet_manifest(tmp_path / f"data-{rank}", rows(160))
    config = WorkerConfig(Workload.model_validate(spec), "classify", str(tmp_path / "run"), 1e9, 1, manifest)
    Trainer(replace(config, audit_samples=True), context).run()
    dist.barrier()  # no rank tears gloo down while another still reads the last collective
    dist.destroy_process_group()


def test_a_resize_keeps_the_global_batch_and_the_data_position(tmp_path: Path) -> None:
    """2 ranks train 3 steps of 16 rows (1 micro-batch each per step) and checkpoint; 1 rank
    resumes with 2 micro-batches per step: every row is trained once, those of the plan's
    first 12 micro-batches (two lanes of 80 rows, read in order: rows 0-47 and 80-127)."""
    w = workload(train={"max_steps": 3}, scaling={"workers": {"min": 1, "max": 2}})
    (tmp_path / "storage").mkdir()
    mp.start_processes(
        _two_rank_attempt, args=(free_port(), tmp_path, w.model_dump(by_alias=True)), nprocs=2, join=True
    )
    latest = str(tmp_path / "storage" / "checkpoint-00000003")
    resumed, context = trainer(
        tmp_path,
        w.model_copy(update={"train": w.train.model_copy(update={"max_steps": 6})}),
        rows(160),
        audit=True,
        latest=latest,
    )
    assert resumed.global_batch == 2 * MICRO and resumed.accum == 2
    resumed.run()
    (resized,) = context.events("resized")
    assert (resized["step"], resized["previous_world_size"], resized["world_size"]) == (3, 2, 1)
    (started,) = context.events("attempt_started")
    assert started["restored_step"] == 3 and started["accumulation"] == 2
    assert resumed.position.step == 6 and resumed.position.samples == 6 * 2 * MICRO
    trained = sorted(
        i
        for audit in (tmp_path / "run" / "audit").glob("rank*.jsonl")
        for line in audit.read_text().splitlines()
        for i in json.loads(line)["ids"]
    )
    assert trained == [*range(48), *range(80, 128)]  # every row exactly once across both attempts


def test_a_checkpoint_with_another_global_batch_is_refused(tmp_path: Path) -> None:
    first, _ = trainer(tmp_path, workload(train={"max_steps": 2}), rows(64))
    first.run()
    other = workload(train={"max_steps": 4, "global_batch_size": 2 * MICRO})
    second, context = trainer(
        tmp_path, other, rows(64), latest=str(tmp_path / "storage" / "checkpoint-00000002")
    )
    second.run()  # one fatal report, no exception: a restart could not help
    (fatal,) = context.events("fatal")
    assert "global batch of 8 rows, this workload asks for 16" in fatal["reason"]
    assert second.position.step == 0 and context.reports[-1].metrics["fatal"] == fatal["reason"]


def test_a_checkpoint_of_other_data_is_refused_unless_accepted(tmp_path: Path) -> None:
    first, _ = trainer(tmp_path, workload(train={"max_steps": 2}), rows(64))
    first.run()
    latest = str(tmp_path / "storage" / "checkpoint-00000002")
    changed, context = trainer(tmp_path, workload(train={"max_steps": 4}), rows(72), latest=latest)
    changed.run()
    (fatal,) = context.events("fatal")
    assert fatal["reason"].startswith("data.train.path: the data changed since the checkpoint was written")
    assert "data.accept_changed_data: true" in fatal["reason"] and changed.position.step == 0
    accepting = workload(train={"max_steps": 4}, data={"accept_changed_data": True})
    accepted, context = trainer(tmp_path, accepting, rows(72), latest=latest)
    accepted.run()
    assert not context.events("fatal") and accepted.position.step == 4


def test_the_last_step_of_each_epoch_logs_what_every_rank_read(tmp_path: Path) -> None:
    """40 rows, global batches of 8: 5 steps an epoch; 12 steps end two epochs (steps 5, 10)."""
    t, context = trainer(tmp_path, workload(train={"max_steps": 12}), rows(40))
    t.run()
    logged = {int(r["step"]): r for r in context.step_records() if "data/bytes_read" in r}
    assert sorted(logged) == [5, 10]
    for values in logged.values():
        assert values["data/rows_trained"] == values["data/0/rows_trained"] == 40
        assert values["data/rows_decoded"] == 40
        assert 0 < values["data/0/bytes_read"] == values["data/bytes_read"] < 1.1 * data_bytes(tmp_path)


def data_bytes(tmp_path: Path) -> int:
    return sum(p.stat().st_size for p in (tmp_path / "data").glob("*.parquet"))
