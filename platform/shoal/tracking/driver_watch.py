"""Records a stop that Ray cut short.

A stop sent to the driver's whole process tree (`scancel`, Ctrl-C in a terminal,
`kill -- -PGID`) reaches Ray's processes on the driver's node as well, and Ray ends a driver
whose node shuts down at once, without running any Python (its object store connection breaks,
and Ray exits the process). The driver then cannot record the stop, and MLflow would say
RUNNING for ever. The watch is a small process outside Ray that is stopped together with the
driver: when the driver ended without closing its MLflow run, the watch records it KILLED.

A driver that ends with no stop sent to its process tree (SIGKILL, the OOM killer) leaves the
run RUNNING, as before: nobody asked it to stop, and `shoal resume` takes such a run over.

Two ways to run it. By default the driver starts it as its child:
`python -P -m shoal.tracking.driver_watch`, with a pipe from the driver as its standard input.
A launcher that signals its processes one by one (Slurm: the Ray head's step, then the batch
script's) runs the driver under it instead, `python -m shoal.tracking.driver_watch shoal run
...`: the watch is then the driver's parent, which the launcher waits for and always signals,
and the driver finds the pipe's number in $SHOAL_WATCH_FD. Through the pipe come the run's URI
and id (never the command line, which any user can read: the URI may hold a password), then
`closed` once the driver has closed the run. MLflow is imported only to record a stop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, BinaryIO

from shoal.redact import redact

CLOSED = b"closed\n"  # what the driver writes once it has closed the run itself
WATCH_FD_ENV = "SHOAL_WATCH_FD"  # the pipe's number in a driver started under the watch
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
    """The driver's end of the watch: `close()` once the driver is done with the run."""

    def __init__(self, pipe: IO[bytes], process: subprocess.Popen | None = None):
        self.pipe, self.process = pipe, process

    @classmethod
    def start(cls, uri: str, run_id: str, stderr: int | None = None) -> DriverWatch | None:
        """The watch this driver runs under, else a new child (what it says goes to the
        driver's stderr); None, with a warning, where neither works: the run goes on."""
        process = None
        try:
            if inherited := os.environ.pop(WATCH_FD_ENV, None):
                os.set_inheritable(int(inherited), False)  # this driver's children never hold it
                pipe = os.fdopen(int(inherited), "wb")
            else:
                process = _spawn(stderr)
                assert process.stdin is not None
                pipe = process.stdin
            pipe.write(json.dumps({"uri": uri, "run_id": run_id}).encode() + b"\n")
            pipe.flush()
        except (OSError, ValueError) as exc:
            if process is not None:
                _end(process, wait_s=0)
            log.warning("a stop that Ray cuts short will not be recorded: %s", exc)
            return None
        return cls(pipe, process)

    def close(self, recorded: bool = True) -> None:
        """`recorded`: the driver closed the run in MLflow itself, and the watch ends without
        a write; otherwise it decides now, from the stops it saw, as if the driver had ended."""
        try:
            if recorded:
                self.pipe.write(CLOSED)
            self.pipe.close()
        except OSError:  # the watch is gone already
            pass
        if self.process is not None:
            _end(self.process, wait_s=CLOSE_WAIT_S + (0 if recorded else STOP_GRACE_S))


def _spawn(stderr: int | None) -> subprocess.Popen:
    """The watch as the driver's child. -P: nothing in the driver's working directory shadows
    what it imports; shoal is found where the driver found it (a notebook may have put it on
    sys.path by hand)."""
    home = str(Path(__file__).resolve().parents[2])
    paths = [home, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    command = [sys.executable, "-P", "-m", "shoal.tracking.driver_watch"]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr, env=env)


def _end(process: subprocess.Popen, wait_s: float) -> None:
    try:
        process.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Stops:
    """The stop signals this process got, from the moment it is made."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # a background job ignores Ctrl-C
                signal.signal(sig, lambda signum, frame: self.seen.append(signum))

    def within(self, seconds: float) -> int | None:
        """The first stop, waiting up to `seconds` for one."""
        deadline = time.monotonic() + seconds
        while not self.seen and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.seen[0] if self.seen else None


def watch(pipe: BinaryIO, stops: Stops) -> int:
    """Reads the driver's pipe until the driver closes the run or ends; records a stop the
    driver could not."""
    first = pipe.readline()
    if not first:
        return 0  # the driver ended before its run was open: nothing to record
    run = json.loads(first)
    if pipe.read() == CLOSED:  # until the driver writes it, or ends
        return 0
    signum = stops.within(STOP_GRACE_S)
    if signum is None:
        return 0  # the driver died unasked (SIGKILL): the run stays RUNNING
    return record_stop(run["uri"], run["run_id"], stop_reason(signum))


def keep(command: list[str], stops: Stops) -> int:
    """Runs `command` (a driver) under the watch; its exit status, as a shell gives it."""
    read_end, write_end = os.pipe()
    try:
        env = {**os.environ, WATCH_FD_ENV: str(write_end)}
        driver = subprocess.Popen(command, env=env, pass_fds=(write_end,))
    except OSError as exc:
        os.close(read_end)
        print(f"shoal: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 127
    finally:
        os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        watch(pipe, stops)
    code = driver.wait()
    return code if code >= 0 else 128 - code


def record_stop(uri: str, run_id: str, reason: str) -> int:
    """The run KILLED, unless the driver closed it after all."""
    # deferred: the watch idles through every run, and MLflow takes a second to import
    from mlflow.entities import RunTag

    from shoal.tracking.mlflow_run import ended_tag, tracking_client

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # one line of its own, said below
    try:
        client = tracking_client(uri)
        if client.get_run(run_id).info.status != "RUNNING":
            return 0
        tags = {**ended_tag(), "shoal.stop_reason": reason}
        client.log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])
        client.set_terminated(run_id, "KILLED")
    except Exception as exc:
        said = redact(f"shoal: {reason}; MLflow run {run_id} could not be recorded as KILLED: {exc}")
        print(said, file=sys.stderr)
        return 1
    said = f"shoal: {reason}; the driver ended before recording it: MLflow run {run_id} is now KILLED"
    print(said, file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    stops = Stops()  # first: a stop may come at any moment
    if argv:
        return keep(argv, stops)
    return watch(sys.stdin.buffer, stops)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
