"""Ctrl-C and SIGTERM while Ray Train fits: they reach shoal's driver, which then records
how the run ended (launch/run.py), instead of Ray's own handler ending the process."""

from __future__ import annotations

import signal
import threading
from typing import Any

from shoal.tracking.driver_watch import stop_reason


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or a SIGTERM (`scancel`, `kill`, a stopped Ray job) while training."""

    def __init__(self, signum: signal.Signals):
        super().__init__(signum)
        self.reason = stop_reason(signum)


def signals_reach_here() -> bool:
    """Python runs signal handlers on the main thread only (a sweep's trials run on others)."""
    return threading.current_thread() is threading.main_thread()


def fit_interruptibly(trainer: Any) -> None:
    """`trainer.fit()` in a helper thread, so that Ctrl-C and SIGTERM reach shoal.

    Called on the main thread, Ray Train installs its own SIGINT handler, which
    aborts the run and exits the process before shoal can record it as KILLED.
    """
    outcome: dict[str, BaseException] = {}

    def target() -> None:
        try:
            trainer.fit()
        except BaseException as exc:  # handed to the main thread below
            outcome["error"] = exc

    def on_signal(signum: int, frame: Any) -> None:
        raise Interrupted(signal.Signals(signum))

    if not signals_reach_here():
        trainer.fit()  # signals belong to whoever owns the main thread
        return
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        fitting = threading.Thread(target=target, name="shoal-fit", daemon=True)
        fitting.start()
        while fitting.is_alive():
            fitting.join(timeout=0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if "error" in outcome:
        raise outcome["error"]
