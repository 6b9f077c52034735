"""The driver's watch, a real process against a real sqlite store (no Ray): it records a
stop the driver could not, and nothing else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from shoal.tracking.driver_watch import STOP_GRACE_S, WATCH_FD_ENV, DriverWatch


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
    watch.pipe.close()


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


def test_a_driver_closing_without_recording_lets_the_watch_decide_at_once(running) -> None:
    client, uri, run_id = running
    watch = started(uri, run_id)
    watch.process.send_signal(signal.SIGINT)  # a Ctrl-C, then recording failed (a second one)
    watch.close(recorded=False)
    assert watch.process.returncode == 0  # close() waited for the watch's decision
    assert client.get_run(run_id).data.tags["shoal.stop_reason"] == "interrupted (Ctrl-C)"


def test_a_driver_under_the_watch_finds_its_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    read_end, write_end = os.pipe()
    monkeypatch.setenv(WATCH_FD_ENV, str(write_end))
    watch = DriverWatch.start("sqlite:////runs/mlflow.db", "abc")
    assert watch is not None and watch.process is None and WATCH_FD_ENV not in os.environ
    assert not os.get_inheritable(write_end)  # this driver's own children never hold it
    watch.close()
    with os.fdopen(read_end, "rb") as pipe:
        first, rest = pipe.readline(), pipe.read()
    assert json.loads(first) == {"uri": "sqlite:////runs/mlflow.db", "run_id": "abc"} and rest == b"closed\n"


# A driver run under the watch (`python -m shoal.tracking.driver_watch CMD...`): it opens its
# run, says so through the pipe, writes its pid, then waits to be stopped or to finish.
FAKE_DRIVER = """
import json, os, sys, time
uri, run_id, pid_file, finish = sys.argv[1:5]
pipe = os.fdopen(int(os.environ["SHOAL_WATCH_FD"]), "wb")
pipe.write(json.dumps({"uri": uri, "run_id": run_id}).encode() + b"\\n")
pipe.flush()
open(pid_file, "w").write(str(os.getpid()))
if finish == "finish":
    pipe.write(b"closed\\n")
    pipe.close()
    sys.exit(3)
time.sleep(60)
"""


def kept(tmp_path: Path, uri: str, run_id: str, finish: bool) -> tuple[subprocess.Popen, int]:
    """The watch running a fake driver: (the watch's process, the driver's pid)."""
    pid_file = tmp_path / "driver.pid"
    fake = [sys.executable, "-c", FAKE_DRIVER, uri, run_id, str(pid_file), "finish" if finish else "wait"]
    keeper = subprocess.Popen(
        [sys.executable, "-m", "shoal.tracking.driver_watch", *fake], stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text() and (finish or handles_sigterm(keeper.pid))):
        assert time.monotonic() < deadline, "the fake driver did not start"
        time.sleep(0.02)
    return keeper, int(pid_file.read_text())


def test_a_driver_under_the_watch_that_ray_ended_is_recorded_killed(running, tmp_path: Path) -> None:
    """As in a Slurm job: the stop reaches the watch (the batch script's child), while Ray has
    already ended the driver."""
    client, uri, run_id = running
    keeper, driver = kept(tmp_path, uri, run_id, finish=False)
    os.kill(driver, signal.SIGKILL)
    time.sleep(STOP_GRACE_S / 4)
    keeper.send_signal(signal.SIGTERM)
    _, said = keeper.communicate(timeout=60)
    assert keeper.returncode == 128 + signal.SIGKILL  # the driver's end, as a shell says it
    assert f"MLflow run {run_id} is now KILLED" in said
    assert client.get_run(run_id).info.status == "KILLED"


def test_a_driver_under_the_watch_that_closed_its_run_keeps_its_exit_status(running, tmp_path: Path) -> None:
    client, uri, run_id = running
    keeper, _ = kept(tmp_path, uri, run_id, finish=True)
    _, said = keeper.communicate(timeout=60)
    assert (keeper.returncode, said) == (3, "")
    assert client.get_run(run_id).info.status == "RUNNING"  # whatever the driver recorded stands


def test_the_watch_says_when_it_cannot_run_the_driver() -> None:
    keeper = subprocess.run(
        [sys.executable, "-m", "shoal.tracking.driver_watch", "/no/such/shoal", "run"],
        capture_output=True,
        text=True,
    )
    assert keeper.returncode == 127
    assert keeper.stderr == "shoal: cannot run /no/such/shoal: No such file or directory\n"
