"""What the fault tests share: waiting, the CLI as a subprocess, checkpoints and sample audits."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from mlflow.tracking import MlflowClient
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shoal.data.epoch_plan import EpochPlan, plan_for
from shoal.data.manifest import build_manifest

# `model.target: slow_model:Slow` once written to the workdir as slow_model.py: at least 50 ms a
# step whatever the CPU, for tests that need a run to last (a server outage under it, the first
# steps logged well before a checkpoint)
SLOW_MODEL = """
import time
import torch

class Slow(torch.nn.Module):
    task = "classify"

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(64, 10)

    def forward(self, x):
        if x.device.type != "meta":
            time.sleep(0.05)
        return self.body(x)
"""


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def registered(run_dir: Path, checkpoint: str) -> bool:
    """Ray Train has committed this checkpoint (its directory appears before that)."""
    try:
        return checkpoint in (run_dir / "checkpoint_manager_snapshot.json").read_text()
    except OSError:
        return False


def registered_steps(run_dir: Path) -> list[int]:
    """The steps of the checkpoints in Ray Train's record of this run, in order."""
    snapshot = (run_dir / "checkpoint_manager_snapshot.json").read_text()
    return sorted({int(step) for step in re.findall(r"checkpoint-(\d{8})", snapshot)})


def worker_pid(run_dir: Path, rank: int) -> int:
    return json.loads((run_dir / "workers" / f"rank{rank}.json").read_text())["pid"]


def loss_steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))


def events(client: MlflowClient, run_id: str, into: Path) -> list[dict]:
    return json.loads(Path(client.download_artifacts(run_id, "events.json", str(into))).read_text())


def shoal_cli(args: list[str], cwd: Path, own_group: bool = False, **env: str) -> subprocess.Popen:
    """`shoal ARGS` in `cwd`; with `own_group`, in a process group of its own (to stop it whole)."""
    return subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", *args],
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=own_group,
    )


def full_state(checkpoint_dir: Path, scratch: Path) -> dict:
    """Model and optimizer state of a sharded checkpoint, gathered into one dict."""
    target = scratch / f"{checkpoint_dir.parent.name}-{checkpoint_dir.name}.pt"
    dcp_to_torch_save(str(checkpoint_dir), str(target))
    return torch.load(target, weights_only=False)


def assert_bitwise_equal(a: dict, b: dict, path: str = "") -> None:
    assert a.keys() == b.keys(), path
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            assert_bitwise_equal(x, y, f"{path}.{key}")
        elif torch.is_tensor(x):
            assert torch.equal(x, y), f"{path}.{key} differs by {(x.double() - y.double()).abs().max()}"
        else:
            assert x == y, f"{path}.{key}"


def applied_records(run_dir: Path) -> list[dict]:
    """The audit records (every rank's) of the optimizer steps the final model went through.

    A step replayed after a restart was recorded by two attempts; the later attempt's
    record is the one that counts (the earlier one's update was lost with its process).
    """
    records = [
        json.loads(line) for path in sorted((run_dir / "audit").glob("rank*.jsonl")) for line in path.open()
    ]
    final_attempt: dict[int, str] = {}
    for record in records:
        current = final_attempt.get(record["step"])
        if current is None or float(record["attempt"]) > float(current):
            final_attempt[record["step"]] = record["attempt"]
    return [r for r in records if r["attempt"] == final_attempt[r["step"]]]


def applied_samples(run_dir: Path) -> tuple[dict[int, Counter], list[int]]:
    """Sample ids per epoch over the applied optimizer steps, and those steps."""
    per_epoch: dict[int, Counter] = defaultdict(Counter)
    steps = set()
    for record in applied_records(run_dir):
        per_epoch[record["epoch"]].update(record["ids"])
        steps.add(record["step"])
    return per_epoch, sorted(steps)


def assert_micro_batches_follow_the_plan(
    run_dir: Path, files: list[str], seed: int, micro: int, global_batch: int, window: int
) -> int:
    """Every applied global micro-batch trained exactly the sample ids the epoch plan gives it:
    those an uninterrupted 1-worker run with this seed trains (data/epoch_plan.py). Returns
    how many micro-batches were checked."""
    manifest = build_manifest(files)
    ids = pa.concat_arrays(
        [pq.read_table(f.path, columns=["id"]).column("id").combine_chunks() for f in manifest.files]
    ).to_numpy()
    plans: dict[int, EpochPlan] = {}
    checked = 0
    for record in applied_records(run_dir):
        epoch = record["epoch"]
        plan = plans.setdefault(epoch, plan_for(manifest, seed, epoch, micro, global_batch, window))
        for index, trained in record["micro"].items():
            expected = ids[plan.micro_batch_rows(int(index))].tolist()
            assert trained == expected, f"epoch {epoch} micro-batch {index}: {trained} != plan {expected}"
            checked += 1
    return checked


def assert_exactly_once(run_dir: Path, steps: int, global_batch: int, rows: int) -> None:
    """Each epoch's samples trained once each: whole epochs hold every usable row once."""
    per_epoch, applied = applied_samples(run_dir)
    assert applied == list(range(1, steps + 1))
    per_full_epoch = (rows // global_batch) * global_batch
    for epoch, seen in per_epoch.items():
        twice = [i for i, n in seen.items() if n > 1]
        assert not twice, f"epoch {epoch}: samples trained twice: {twice[:10]}"
        if epoch < max(per_epoch):  # a finished epoch
            assert sum(seen.values()) == per_full_epoch, f"epoch {epoch}: {sum(seen.values())} samples"
    assert sum(sum(c.values()) for c in per_epoch.values()) == steps * global_batch


def assert_every_evaluation_saw_the_validation_set_once(run_dir: Path, val_files: list[str]) -> list[int]:
    """The latest evaluation at each step (its attempt's, every data-parallel slot's share
    together) held every validation sample exactly once. Returns the steps checked."""
    val_ids = Counter(
        i
        for f in build_manifest(val_files).files
        for i in pq.read_table(f.path, columns=["id"])["id"].to_pylist()
    )
    records = [
        json.loads(line)
        for path in sorted((run_dir / "audit").glob("eval-rank*.jsonl"))
        for line in path.open()
    ]
    latest: dict[int, str] = {}
    for record in records:
        if record["step"] not in latest or float(record["attempt"]) > float(latest[record["step"]]):
            latest[record["step"]] = record["attempt"]
    for step, attempt in sorted(latest.items()):
        shares = [r for r in records if r["step"] == step and r["attempt"] == attempt]
        assert sorted(r["slot"] for r in shares) == list(range(shares[0]["slots"])), f"step {step}: {shares}"
        seen = Counter(i for r in shares for i in r["ids"])
        assert seen == val_ids, (
            f"evaluation at step {step}: {sum(seen.values())} ids, {len(val_ids)} in the set"
        )
    return sorted(latest)
