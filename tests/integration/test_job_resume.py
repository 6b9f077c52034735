"""Job-level faults: the driver SIGKILLed mid-run, then `shoal resume RUN_ID`; full and
read-only checkpoint storage (real tmpfs mounts, so root only)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from shoal.worker.checkpoint import format as checkpoint_format
from tests.conftest import WORKLOADS, quickstart
from tests.integration.conftest import run_workload
from tests.integration.helpers import events, loss_steps, registered, shoal_cli, wait_for

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def run_and_stop_driver(
    args: list[str], cwd: Path, run_dir: Path, checkpoint_name: str, sig: int
) -> tuple[int, str, str]:
    driver = shoal_cli(args, cwd)
    wait_for(lambda: registered(run_dir, checkpoint_name) or driver.poll() is not None, 300, checkpoint_name)
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
    assert run.info.status == "KILLED" and max(loss_steps(client, run.info.run_id)) >= 50

    # The same command resumes from the latest checkpoint; this time the driver is SIGKILLed:
    # no handler runs, so MLflow still says RUNNING.
    run_and_stop_driver(args, workdir, run_dir, "checkpoint-00000100", signal.SIGKILL)
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
    assert len(starts) >= 3 and starts[0]["restored_step"] is None and starts[-1]["restored_step"] >= 100
    assert 50 <= starts[1]["restored_step"] < 100
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
    spec = str(WORKLOADS / "quickstart.yaml")
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


@needs_root
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_full_storage_fails_clearly_and_keeps_earlier_checkpoints(workdir: Path, background: bool) -> None:
    small = workdir / "small"
    _mount_tmpfs(small, "size=1200k")  # room for about three checkpoints of the quickstart CNN
    try:
        data = quickstart()
        data["checkpoint"].update(every_steps=20, keep=10, storage=str(small), **{"async": background})
        data["train"]["max_steps"] = 120  # the storage fills at about step 80
        data["failure"]["max_restarts"] = 0
        result = run_workload(workdir, data, ["train.eval_every=1000"], "full")
        assert result.status == "FAILED"
        assert "No space left on device" in result.reason and str(small) in result.reason
        run_dir = small / "full"
        snapshot = (run_dir / "checkpoint_manager_snapshot.json").read_text()
        committed = [p for p in run_dir.glob("checkpoint-*") if p.name in snapshot]
        assert committed, "no checkpoint was committed before the storage filled up"
        for directory in committed:
            assert checkpoint_format.verify(directory) is None, directory
        assert len(result.reason.splitlines()) == 1

        # Room again: the same run name resumes from the newest committed checkpoint, never
        # from what the full disk left half written.
        subprocess.run(["mount", "-o", "remount,size=16m", str(small)], check=True)
        newest = max(int(p.name.removeprefix("checkpoint-")) for p in committed)
        again = run_workload(workdir, data, ["train.eval_every=1000"], "full")
        assert again.status == "FINISHED" and again.run_id == result.run_id, again.reason
        assert again.resumed_from == newest
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
