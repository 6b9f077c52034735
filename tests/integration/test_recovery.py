"""Worker faults on the shared cluster, audited: exact resume, exactly-once data, NaN policies, hangs.

Every run records the sample ids of each applied optimizer step (SHOAL_AUDIT_SAMPLES=1).
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from shoal.data import prepare
from shoal.data.sources import parquet_files
from shoal.worker.checkpoint import format as checkpoint_format
from tests.conftest import quickstart
from tests.integration.conftest import run_in_thread, run_workload
from tests.integration.helpers import (
    applied_samples,
    assert_bitwise_equal,
    assert_every_evaluation_saw_the_validation_set_once,
    assert_exactly_once,
    assert_micro_batches_follow_the_plan,
    events,
    full_state,
    loss_steps,
    registered,
    wait_for,
    worker_pid,
)

DIGITS_TRAIN_ROWS, GLOBAL_BATCH = 1438, 128


def digits_train() -> list[str]:
    return parquet_files(str(prepare("digits") / "train"), "digits")


@pytest.fixture(autouse=True)
def audited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_AUDIT_SAMPLES", "1")


def recovery_workload(strategy: str, background: bool) -> dict:
    data = quickstart()
    data["train"].update(max_steps=60, eval_every=15)
    data["parallel"] = {"strategy": strategy}
    data["scaling"]["threads_per_worker"] = 1  # bitwise reproducibility needs a fixed thread count
    data["checkpoint"].update(every_steps=15, keep=2, keep_best={"metric": "val/loss", "mode": "min"})
    data["checkpoint"]["async"] = background
    return data


@pytest.mark.parametrize(
    ("strategy", "background"), [("ddp", False), ("fsdp", True)], ids=["ddp-sync", "fsdp-async"]
)
def test_sigkilled_worker_resumes_bitwise_and_exactly_once(
    workdir: Path, strategy: str, background: bool
) -> None:
    data = recovery_workload(strategy, background)
    reference = run_workload(workdir, data, [], "reference")
    assert reference.ok, reference.reason

    runner, outcome = run_in_thread(workdir, data, "killed")
    run_dir = workdir / "shoal_runs" / "killed"
    wait_for(lambda: registered(run_dir, "checkpoint-00000030"), 300, "checkpoint 30")
    victim = worker_pid(run_dir, 1)
    os.kill(victim, signal.SIGKILL)
    runner.join(timeout=400)
    result = outcome["result"]
    assert result.ok, result.reason
    assert result.restarts >= 1 and worker_pid(run_dir, 1) != victim

    # Same weights and optimizer state, bit for bit, as the run that was never interrupted.
    final = "checkpoint-00000060"
    assert_bitwise_equal(
        full_state(workdir / "shoal_runs" / "reference" / final, workdir),
        full_state(run_dir / final, workdir),
    )
    # Every sample of every epoch in exactly one applied step, replayed steps counted once,
    # and each global micro-batch the plan's: what an uninterrupted 1-worker run trains.
    assert_exactly_once(run_dir, 60, GLOBAL_BATCH, DIGITS_TRAIN_ROWS)
    assert assert_micro_batches_follow_the_plan(run_dir, digits_train(), 0, 64, GLOBAL_BATCH, 8192) == 60 * 2
    # Each evaluation (2 workers) saw every validation sample once, the one replayed too.
    digits_val = parquet_files(str(prepare("digits") / "val"), "digits")
    assert assert_every_evaluation_saw_the_validation_set_once(run_dir, digits_val) == [15, 30, 45, 60]

    client = MlflowClient(result.tracking_uri)
    assert loss_steps(client, result.run_id) == list(range(1, 61))
    tags = client.get_run(result.run_id).data.tags
    assert int(tags["shoal.restarts"]) >= 1 and int(tags["shoal.attempts"]) >= 2
    history = events(client, result.run_id, workdir)
    assert "failure" in [e["kind"] for e in history]
    restored = [e["restored_step"] for e in history if e["kind"] == "attempt_started"]
    assert restored[0] is None and restored[-1] >= 30

    # Retention: Ray keeps the latest 2; the driver keeps the best by val/loss beside them.
    kept = sorted(p.name for p in run_dir.glob("checkpoint-*"))
    assert kept == ["checkpoint-00000045", "checkpoint-00000060"]
    best = json.loads((run_dir / "best.json").read_text())
    val = {m.step: m.value for m in client.get_metric_history(result.run_id, "val/loss")}
    assert best["value"] == min(val[s] for s in (15, 30, 45, 60))
    assert checkpoint_format.verify(run_dir / "best-checkpoint") is None
    assert tags["shoal.best_step"] == str(best["step"])


def poisoned_digits(workdir: Path, bad_ids: list[int]) -> dict:
    """Digits with a few rows whose features are infinite: their steps' loss is not finite."""
    source = prepare("digits")
    table = pq.read_table(source / "train")
    x = table.column("x").to_pylist()
    ids = table.column("id").to_pylist()
    for row, sample in enumerate(ids):
        if sample in bad_ids:
            x[row] = [float("inf")] * len(x[row])
    target = workdir / "poisoned"
    target.mkdir()
    poisoned = table.set_column(table.schema.get_field_index("x"), "x", [x])
    pq.write_table(poisoned.cast(table.schema), target / "train.parquet", row_group_size=32)
    return {"train": {"path": str(target)}, "val": {"path": str(source / "val")}, "batch_size": 64}


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_non_finite_loss_policies(workdir: Path, policy: str) -> None:
    bad_ids = pq.read_table(prepare("digits") / "train", columns=["id"]).column("id").to_pylist()[:2]
    data = quickstart()
    data["data"] = poisoned_digits(workdir, bad_ids)
    data["train"].update(max_steps=None, epochs=2, eval_every=None)
    data["checkpoint"]["every_steps"] = 4
    data["failure"].update(on_nan=policy, max_nan_steps=4)
    result = run_workload(workdir, data, [], policy)
    assert result.ok, result.reason
    client = MlflowClient(result.tracking_uri)
    history = events(client, result.run_id, workdir)
    hits = [e for e in history if e["kind"] == f"nan_{policy}"]
    assert hits, "the poisoned rows never reached a step"
    if policy == "rollback":
        rollbacks = [e for e in history if e["kind"] == "rolled_back"]
        assert len(rollbacks) == len(hits) and all(e["restored_step"] is not None for e in rollbacks)
    per_epoch, applied = applied_samples(workdir / "shoal_runs" / policy)
    steps_per_epoch = DIGITS_TRAIN_ROWS // GLOBAL_BATCH
    assert len(applied) == 2 * steps_per_epoch - len(hits)
    poisoned = [str(workdir / "poisoned" / "train.parquet")]
    checked = assert_micro_batches_follow_the_plan(
        workdir / "shoal_runs" / policy, poisoned, 0, 64, GLOBAL_BATCH, 8192
    )
    assert checked == 2 * len(applied)
    for epoch, seen in per_epoch.items():
        left_out = {e["step_in_epoch"] for e in hits if e["epoch"] == epoch}
        # every whole step of the epoch was either applied or left out for its non-finite loss
        assert sum(seen.values()) == (steps_per_epoch - len(left_out)) * GLOBAL_BATCH
        assert not set(bad_ids) & set(seen) and max(seen.values()) == 1
    losses = [
        m.value for m in sorted(client.get_metric_history(result.run_id, "train/loss"), key=lambda m: m.step)
    ]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5  # it learned


def test_hung_rank_is_detected_dumped_and_restarted(workdir: Path) -> None:
    data = quickstart()
    # Reports, not steps, pace a fast run (Ray holds one per worker until its 2 s poll): with
    # four checkpoints still to come, rank 0 has steps left whenever rank 1 stops.
    data["train"].update(max_steps=200, eval_every=None)
    data["checkpoint"]["every_steps"] = 40
    data["failure"]["hang_timeout_s"] = 10
    runner, outcome = run_in_thread(workdir, data, "hung")
    run_dir = workdir / "shoal_runs" / "hung"
    wait_for(lambda: registered(run_dir, "checkpoint-00000040"), 300, "checkpoint 40")
    stopped = worker_pid(run_dir, 1)
    os.kill(stopped, signal.SIGSTOP)  # rank 0 now waits for it in the step's all-reduce
    runner.join(timeout=400)
    result = outcome["result"]
    assert result.ok, result.reason
    assert result.restarts >= 1
    dump = (run_dir / "logs" / "hang-rank0.txt").read_text()
    # rank 0's stack, caught waiting for its peer: in DDP's gradient all-reduce (inside
    # backward) or in the per-step all-reduce of the loss
    # the countdown is 1.1 x hang_timeout_s (the watchdog re-arms once a tenth of it has passed)
    assert "Timeout (0:00:11)!" in dump and "in _train_stream" in dump
    assert "in backward" in dump or "in reduce" in dump
    assert_exactly_once(run_dir, 200, GLOBAL_BATCH, DIGITS_TRAIN_ROWS)
