"""Records a stop that Ray cut short.

A stop sent to the driver's whole process tree (`scancel`, Ctrl-C in a terminal,
`kill -- -PGID`) reaches Ray's processes on the driver's node as well, and Ray ends a driver
whose node shuts down at once, without running any Python (its object store connection breaks,
and Ray exits the process). The driver then cannot record the stop, and MLflow would say
RUNNING for ever. The watch is a small child process of the driver's, outside Ray: it is
stopped together with the driver, and when the driver ended without closing its MLflow run,
the watch records the run KILLED.

A driver that ends with no stop sent to its process tree (SIGKILL, the OOM killer) leaves the
run RUNNING, as before: nobody asked it to stop, and `shoal resume` takes such a run over.

Started as `python -m shoal.tracking.driver_watch` with a pipe from the driver as its standard
input (the run's URI and id, then `closed` once the driver closed the run); MLflow is imported
only when there is something to record.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from types import FrameType

CLOSED = b"closed\n"  # what the driver writes once it has closed the run itself
# A stop may reach the watch just after Ray ended the driver: Slurm signals a job's steps one
# after another, the Ray head's before the batch script's.
STOP_GRACE_S = 2.0
CLOSE_WAIT_S = 10.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
log = logging.getLogger("shoal")


def stop_reason(signum: int) -> str:
    """How a run's summary names the signal that stopped it."""
    return "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


class DriverWatch:
    """The driver's end of the watch: `close()` once the run is closed in MLflow."""

    def __init__(self, process: subprocess.Popen):
        self.process = process

    @classmethod
    def start(cls, uri: str, run_id: str, stderr: int | None = None) -> DriverWatch | None:
        """The watch (what it says goes to the driver's stderr), or None, with a warning,
        where it cannot start: the run goes on. The URI goes through the pipe, not the
        command line, which any user of the machine can read (it may hold a password)."""
        command = [sys.executable, "-m", "shoal.tracking.driver_watch"]
        try:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=stderr)
            assert process.stdin is not None
            process.stdin.write(json.dumps({"uri": uri, "run_id": run_id}).encode() + b"\n")
            process.stdin.flush()
        except OSError as exc:
            log.warning("a stop that Ray cuts short will not be recorded: %s", exc)
            return None
        return cls(process)

    def close(self) -> None:
        """The driver recorded the run's end itself: the watch ends without a write."""
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(CLOSED)
            self.process.stdin.close()
        except OSError:  # the watch is gone already (stopped with a second signal)
            pass
        try:
            self.process.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()


def watch() -> int:
    """Waits for the driver to close the run or to end; records a stop the driver could not."""
    stops: list[int] = []

    def on_stop(signum: int, frame: FrameType | None) -> None:
        stops.append(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_stop)
    run = json.loads(sys.stdin.buffer.readline())
    if sys.stdin.buffer.read() == CLOSED:  # until the driver writes it, or ends
        return 0
    deadline = time.monotonic() + STOP_GRACE_S
    while not stops and time.monotonic() < deadline:
        time.sleep(0.05)
    if not stops:
        return 0  # the driver died unasked (SIGKILL): the run stays RUNNING
    return record_stop(run["uri"], run["run_id"], stop_reason(stops[0]))


def record_stop(uri: str, run_id: str, reason: str) -> int:
    """The run KILLED, unless the driver closed it after all."""
    # deferred: the watch idles through every run, and MLflow takes a second to import
    from mlflow.entities import RunTag

    from shoal.tracking.mlflow_run import tracking_client

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # one line of its own, said below
    try:
        client = tracking_client(uri)
        if client.get_run(run_id).info.status != "RUNNING":
            return 0
        ended = time.strftime("%Y-%m-%dT%H:%M:%S")
        client.log_batch(run_id, tags=[RunTag("shoal.ended", ended), RunTag("shoal.stop_reason", reason)])
        client.set_terminated(run_id, "KILLED")
    except Exception as exc:
        print(f"shoal: {reason}; MLflow run {run_id} could not be recorded as KILLED: {exc}", file=sys.stderr)
        return 1
    said = f"shoal: {reason}; the driver ended before recording it: MLflow run {run_id} is now KILLED"
    print(said, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(watch())
