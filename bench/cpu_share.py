"""Who had the cores during a contender's steady state: the profile behind the ratios.

On a 2-core machine every process beside the two trainers takes time from
them, and a preempted rank stalls the other at the next all-reduce. A sampler
thread snapshots every process's CPU ticks from /proc every few seconds (cheap:
a few milliseconds a snapshot); afterwards the snapshots that bracket the
steady-state window give each process's share of it.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
Snapshot = dict[int, tuple[int, str, int]]  # pid -> (user + system ticks, name, start time in ticks)


def _name(pid: int, comm: str) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return comm
    words = [a.decode(errors="replace").strip() for a in argv if a.strip()]
    if not words:
        return "kernel threads"  # their names (kworker/0:2-events...) change as they work
    if words[0].startswith("ray::"):
        return words[0]
    script = next((w for w in words[1:] if w.endswith(".py") or "/bin/" in w), words[0])
    return os.path.basename(script)


def stat_fields(stat: str) -> tuple[str, list[str]]:
    """A /proc stat line, a process's or a thread's: its name, and the fields after the name."""
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()


def cpu_seconds(stat_file: Path) -> float:
    """User + system CPU seconds from /proc/PID/stat or /proc/PID/task/TID/stat."""
    _, rest = stat_fields(stat_file.read_text())
    return (int(rest[11]) + int(rest[12])) / TICKS_PER_S


def snapshot() -> Snapshot:
    taken: Snapshot = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm, rest = stat_fields(stat)
        taken[int(entry)] = (int(rest[11]) + int(rest[12]), _name(int(entry), comm), int(rest[19]))
    return taken


@dataclass
class CpuSampler:
    every_s: float = 1.0
    taken: list[tuple[float, Snapshot]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.taken.append((time.time(), snapshot()))
            self._stop.wait(self.every_s)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def shares(self, start: float, end: float) -> dict[str, float]:
        """Cores used by each process name (summed over its processes) between the first
        snapshot after `start` and the last before `end`; {} if the window is too short."""
        inside = [(t, s) for t, s in self.taken if start <= t <= end]
        if len(inside) < 2:
            return {}
        (t0, first), (t1, last) = inside[0], inside[-1]
        used: dict[str, float] = {}
        for pid, (ticks, name, start) in last.items():
            if pid == os.getpid():
                continue  # the bench runner itself (this sampler)
            earlier = first.get(pid)
            before = earlier[0] if earlier and earlier[2] == start else 0  # else a new process
            if ticks > before:
                used[name] = used.get(name, 0.0) + (ticks - before) / TICKS_PER_S / (t1 - t0)
        return used


TRAINER_NAMES = ("ray::RayTrainWorker", "torchrun_ddp.py")


def trainer_cores(shares: dict[str, float]) -> float:
    return sum(v for k, v in shares.items() if k.startswith(TRAINER_NAMES))


def others(shares: dict[str, float], top: int = 6) -> list[tuple[str, float]]:
    rest = [(k, v) for k, v in shares.items() if not k.startswith(TRAINER_NAMES)]
    return sorted(rest, key=lambda kv: -kv[1])[:top]
