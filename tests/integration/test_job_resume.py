"""Job-level faults: the driver SIGKILLed mid-run, then `shoal resume RUN_ID`; full and
read-only checkpoint storage (real tmpfs mounts, so root only)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from shoal.worker.checkpoint import format as checkpoint_format
from tests.conftest import WORKLOADS, quickstart, write_workload
from tests.integration.conftest import run_workload
from tests.integration.helpers import (
    SLOW_MODEL,
    events,
    loss_steps,
    registered,
    registered_steps,
    shoal_cli,
    wait_for,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def run_and_stop_driver(
    args: list[str], cwd: Path, run_dir: Path, checkpoint_name: str, sig: int, ready=lambda: True
) -> tuple[int, str, str]:
    driver = shoal_cli(args, cwd)
    wait_for(
        lambda: (registered(run_dir, checkpoint_name) and ready()) or driver.poll() is not None,
        300,
        checkpoint_name,
    )
    assert driver.poll() is None, "the run ended before it could be stopped"
    driver.send_signal(sig)
    out, err = driver.communicate(timeout=120)
    return driver.returncode, out, err


def test_ctrl_c_and_killed_driver_resume_into_the_same_mlflow_run(workdir: Path, ray_cluster: str) -> None:
    spec = str(WORKLOADS / "quickstart.yaml")
    args = ["run", spec, "--address", ray_cluster, "--run-name", "drv", "--set", "checkpoint.every_steps=25"]
    args += ["--set", "train.max_steps=200"]
    run_dir = workdir / "shoal_runs" / "drv"
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")

    code, out, err = run_and_stop_driver(args, workdir, run_dir, "checkpoint-00000050", signal.SIGINT)
    assert code == 130 and "KILLED" in out and "Traceback" not in err, err
    (run,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    logged, stopped_at = loss_steps(client, run.info.run_id), registered_steps(run_dir)[-1]
    assert run.info.status == "KILLED" and max(logged) >= stopped_at >= 50  # Ctrl-C aborted training:
    assert logged == list(range(1, max(logged) + 1))  # nothing was checkpointed that MLflow lacks
    assert stopped_at + 50 < 200, f"training went on to step {stopped_at} after Ctrl-C"

    # The same command resumes from the latest checkpoint; this time the driver is SIGKILLed:
    # no handler runs, so MLflow still says RUNNING.
    # SIGKILLed once MLflow has the steps up to that checkpoint: a resume from it then leaves
    # no gap, whichever later checkpoint Ray registers before it ends the driver's actors
    target = stopped_at + 50
    run_and_stop_driver(
        args,
        workdir,
        run_dir,
        f"checkpoint-{target:08d}",
        signal.SIGKILL,
        ready=lambda: max(loss_steps(client, run.info.run_id)) >= target,
    )
    (orphan,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert orphan.info.run_id == run.info.run_id and orphan.info.status == "RUNNING"

    other_dir = workdir / "elsewhere"  # resume works from any directory: the run records where it was
    other_dir.mkdir()
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    second = shoal_cli(
        ["resume", orphan.info.run_id, "--tracking-uri", uri, "--address", ray_cluster], other_dir
    )
    out, err = second.communicate(timeout=400)
    assert second.returncode == 0, err
    assert f"MLflow run id: {orphan.info.run_id}" in out
    resumed = client.get_run(orphan.info.run_id)
    assert resumed.info.status == "FINISHED"
    assert loss_steps(client, orphan.info.run_id) == list(range(1, 201))
    history = events(client, orphan.info.run_id, workdir)
    starts = [e for e in history if e["kind"] == "attempt_started"]
    assert len(starts) >= 3 and starts[0]["restored_step"] is None
    assert starts[-1]["restored_step"] >= stopped_at + 50
    assert starts[1]["restored_step"] == stopped_at
    assert len(client.search_runs([resumed.info.experiment_id])) == 1
    assert [e["kind"] for e in history].count("job_resumed") == 2
    assert int(resumed.data.tags["shoal.attempts"]) == len(starts)

    again = shoal_cli(["resume", orphan.info.run_id, "--tracking-uri", uri], other_dir)
    _, err = again.communicate(timeout=60)
    assert again.returncode == 2 and "already FINISHED" in err and "Traceback" not in err


def test_a_driver_killed_before_its_first_checkpoint_leaves_no_run_running(
    workdir: Path, ray_cluster: str
) -> None:
    """SIGKILL before any checkpoint, then the same command again: it takes the RUNNING
    MLflow run over, trains from step 0 and finishes it, each step logged once."""
    # At least 50 ms a step whatever the CPU: the first steps reach MLflow (reports go every
    # 3 s, Ray's controller polls every 2) long before step 300's checkpoint, 15 s or more in.
    (workdir / "slow_model.py").write_text(SLOW_MODEL)
    data = quickstart()
    data["model"] = {"target": "slow_model:Slow"}
    spec = str(write_workload(workdir, data))
    args = ["run", spec, "--address", ray_cluster, "--run-name", "early", "--set", "train.max_steps=300"]
    args += ["--set", "checkpoint.every_steps=300", "--set", "train.eval_every=1000"]
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")

    def logged() -> list:
        found = client.get_experiment_by_name("quickstart")
        return client.search_runs([found.experiment_id]) if found else []

    driver = shoal_cli(args, workdir)
    wait_for(
        lambda: driver.poll() is not None or (logged() and loss_steps(client, logged()[0].info.run_id)),
        300,
        "steps",
    )
    assert driver.poll() is None, "the run ended before it could be killed"
    driver.send_signal(signal.SIGKILL)
    driver.communicate(timeout=60)
    (orphan,) = logged()
    assert orphan.info.status == "RUNNING" and not list(
        (workdir / "shoal_runs" / "early").glob("checkpoint-*")
    )

    again = shoal_cli(args, workdir)
    out, err = again.communicate(timeout=400)
    assert again.returncode == 0, err
    assert f"MLflow run {orphan.info.run_id} was left RUNNING" in err and "Traceback" not in err
    (run,) = logged()
    assert run.info.run_id == orphan.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["shoal.taken_over_from"] == "RUNNING"
    assert loss_steps(client, run.info.run_id) == list(range(1, 301))


def test_a_stop_whose_driver_ray_ended_at_once_is_recorded_killed(workdir: Path, ray_cluster: str) -> None:
    """`scancel` stops Ray on the driver's node together with the driver, and Ray then ends the
    driver before it runs any Python (seen in the Slurm test). Here the stop reaches the
    driver's process group and the driver is SIGKILLed at once: its watch records the run."""
    spec = str(WORKLOADS / "quickstart.yaml")
    args = ["run", spec, "--address", ray_cluster, "--run-name", "cut", "--set", "train.max_steps=2000"]
    audit = workdir / "shoal_runs" / "cut" / "audit" / "rank0.jsonl"
    driver = shoal_cli(args, workdir, own_group=True, SHOAL_AUDIT_SAMPLES="1")
    wait_for(lambda: driver.poll() is not None or (audit.exists() and audit.stat().st_size > 0), 300, "steps")
    assert driver.poll() is None, "the run ended before it could be stopped"
    os.killpg(driver.pid, signal.SIGTERM)
    driver.kill()
    _, err = driver.communicate(timeout=60)  # its stderr closes once the watch has ended too
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert run.info.status == "KILLED" and run.data.tags["shoal.stop_reason"] == "stopped by SIGTERM"
    said = f"the driver ended before recording it: MLflow run {run.info.run_id} is now KILLED"
    assert f"shoal: stopped by SIGTERM; {said}" in err and "Traceback" not in err, err


def _mount_tmpfs(path: Path, options: str) -> None:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("checkpoint-"))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _fill(mount: Path, leave_bytes: int) -> None:
    """Take all but `leave_bytes` of a filesystem's free space, as another tenant would."""
    free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
    with open(mount / "filler", "wb") as filler:
        filler.write(b"\0" * max(free - leave_bytes, 0))


@needs_root
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_full_storage_fails_clearly_and_keeps_earlier_checkpoints(workdir: Path, background: bool) -> None:
    small = workdir / "small"
    _mount_tmpfs(small, "size=16m")
    try:
        data = quickstart()
        data["checkpoint"].update(every_steps=20, keep=10, storage=str(small), **{"async": background})
        data["train"]["max_steps"] = 300
        data["failure"]["max_restarts"] = 0
        run_dir = small / "full"
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(run_workload, workdir, data, ["train.eval_every=1000"], "full")
            # The disk fills once Ray Train has committed a checkpoint: filled by step count
            # instead, a fast machine writes them all before the controller's next poll.
            wait_for(lambda: registered(run_dir, "checkpoint-00000020") or first.done(), 300, "a checkpoint")
            assert not first.done(), "the run ended before its storage could fill"
            _fill(small, leave_bytes=64 * 1024)  # less than one checkpoint of the quickstart CNN
            result = first.result(timeout=300)
        assert result.status == "FAILED"
        assert "No space left on device" in result.reason and str(small) in result.reason
        snapshot = (run_dir / "checkpoint_manager_snapshot.json").read_text()
        committed = [p for p in run_dir.glob("checkpoint-*") if p.name in snapshot]
        assert committed, "no checkpoint was committed before the storage filled up"
        for directory in committed:
            assert checkpoint_format.verify(directory) is None, directory
        assert len(result.reason.splitlines()) == 1

        # Room again: the same run name resumes from the newest committed checkpoint or, where
        # the full disk cut Ray Train's record of them short, from an intact one that leaves
        # MLflow no gap (the step check below); never from what the full disk left half written.
        (small / "filler").unlink()
        intact = [_step_of(p) for p in run_dir.glob("checkpoint-*") if checkpoint_format.verify(p) is None]
        again = run_workload(workdir, data, ["train.eval_every=1000"], "full")
        assert again.status == "FINISHED" and again.run_id == result.run_id, again.reason
        if _is_json(snapshot):
            assert again.resumed_from == max(_step_of(p) for p in committed)
        else:
            assert again.resumed_from in intact
        client = MlflowClient(again.tracking_uri)
        assert loss_steps(client, again.run_id) == list(range(1, data["train"]["max_steps"] + 1))
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


@needs_root
def test_read_only_storage_is_refused_before_launch(workdir: Path) -> None:
    frozen = workdir / "frozen"
    _mount_tmpfs(frozen, "ro,size=1m")
    try:
        spec = str(WORKLOADS / "quickstart.yaml")
        proc = shoal_cli(["run", spec, "--set", f"checkpoint.storage={frozen}/runs"], workdir)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, err
        assert "checkpoint.storage" in err and str(frozen) in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1
    finally:
        subprocess.run(["umount", "-l", str(frozen)], check=False)
