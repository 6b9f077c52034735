"""The driver's watch, a real process against a real sqlite store (no Ray): it records a
stop the driver could not, and nothing else."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from shoal.tracking.driver_watch import STOP_GRACE_S, DriverWatch


@pytest.fixture
def running(tmp_path: Path) -> tuple[MlflowClient, str, str]:
    """A RUNNING run in a fresh sqlite store: (client, uri, run id)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("watched"))
    return client, uri, run.info.run_id


def started(uri: str, run_id: str) -> DriverWatch:
    """A watch that handles stops already (a driver starts it long before any stop)."""
    watch = DriverWatch.start(uri, run_id, stderr=subprocess.PIPE)
    assert watch is not None
    deadline = time.monotonic() + 30
    while not handles_sigterm(watch.process.pid):
        assert watch.process.poll() is None and time.monotonic() < deadline, "the watch did not start"
        time.sleep(0.02)
    # the URI may hold a password: it goes through the pipe, never the command line (`ps`)
    assert uri.encode() not in Path(f"/proc/{watch.process.pid}/cmdline").read_bytes()
    return watch


def handles_sigterm(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def driver_ends(watch: DriverWatch) -> None:
    """The driver's end of the pipe closes without a word, as when Ray exits the driver."""
    assert watch.process.stdin is not None
    watch.process.stdin.close()


def ended(watch: DriverWatch) -> tuple[int, str]:
    """The watch's exit status and what it said."""
    assert watch.process.stderr is not None
    said = watch.process.stderr.read().decode()  # until the watch ends
    return watch.process.wait(timeout=60), said


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_the_driver_could_not_record_is_recorded_killed(running, sig: signal.Signals) -> None:
    client, uri, run_id = running
    watch = started(uri, run_id)
    watch.process.send_signal(sig)  # the stop reaches the whole process tree
    driver_ends(watch)
    reason = "stopped by SIGTERM" if sig == signal.SIGTERM else "interrupted (Ctrl-C)"
    said = f"shoal: {reason}; the driver ended before recording it: MLflow run {run_id} is now KILLED\n"
    assert ended(watch) == (0, said)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.info.end_time is not None
    assert run.data.tags["shoal.stop_reason"] == reason and "shoal.ended" in run.data.tags


def test_a_stop_arriving_just_after_the_driver_ended_is_recorded(running) -> None:
    client, uri, run_id = running
    watch = started(uri, run_id)
    driver_ends(watch)  # Ray ended the driver first; the stop for the driver's step comes after
    time.sleep(STOP_GRACE_S / 4)
    watch.process.send_signal(signal.SIGTERM)
    assert ended(watch)[0] == 0
    assert client.get_run(run_id).info.status == "KILLED"


def test_a_run_the_driver_closed_is_left_as_it_is(running) -> None:
    client, uri, run_id = running
    watch = started(uri, run_id)
    watch.process.send_signal(signal.SIGTERM)  # the driver handled this stop itself...
    watch.close()  # ...and said so: whatever it recorded stands (here: nothing)
    assert watch.process.returncode == 0
    assert client.get_run(run_id).info.status == "RUNNING"
    assert "shoal.stop_reason" not in client.get_run(run_id).data.tags


def test_a_driver_that_died_unasked_leaves_its_run_running(running) -> None:
    client, uri, run_id = running
    watch = started(uri, run_id)
    driver_ends(watch)  # SIGKILL, the OOM killer: no stop was sent
    assert ended(watch) == (0, "")
    assert client.get_run(run_id).info.status == "RUNNING"


def test_a_run_closed_by_the_time_the_watch_looks_is_not_rewritten(running) -> None:
    client, uri, run_id = running
    watch = started(uri, run_id)
    client.set_terminated(run_id, "FINISHED")  # the driver closed it, then Ray ended it
    watch.process.send_signal(signal.SIGTERM)
    driver_ends(watch)
    assert ended(watch) == (0, "")
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_watch_that_cannot_record_says_so(tmp_path: Path) -> None:
    watch = started(f"sqlite:///{tmp_path / 'mlflow.db'}", "no-such-run")
    watch.process.send_signal(signal.SIGTERM)
    driver_ends(watch)
    code, said = ended(watch)
    assert code == 1, said
    assert said.startswith("shoal: stopped by SIGTERM; MLflow run no-such-run could not be recorded"), said
