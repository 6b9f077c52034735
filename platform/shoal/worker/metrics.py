"""What each worker measures per step: phase times, FLOPs, peak memory, GPU readings, and
which workers straggle.

A worker's own share of a step (`busy`) is its data wait plus its forward passes:
the backward pass ends in collectives where fast workers wait for slow ones, so
only the part before them tells workers apart.
"""

from __future__ import annotations

import bisect
import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Set
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from shoal.data.reader import ReadCounts
from shoal.messages import (
    ACROSS_RANKS,
    GPU_PREFIX,
    WORKER_PREFIX,
    DataCount,
    EventKind,
    GpuReading,
    Metric,
    WorkerValue,
    across_ranks,
    data_metric,
    gpu_metric,
    worker_metric,
)
from shoal.spec.schema import MonitorSpec
from shoal.worker.links import LINK_ADDRESS, NO_READING, address_of


class PhaseClock:
    """Seconds per named phase of the current step. On CUDA, spans are timed with events
    read after the step's own synchronisation, so measuring adds no device sync."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, Any, Any]] = []

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((name, start, end))
            return
        started = time.perf_counter()
        yield
        self.seconds[name] += time.perf_counter() - started

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def take(self) -> dict[str, float]:
        """This step's phases (the caller has synchronised); the clock starts afresh."""
        for name, start, end in self._events:
            end.synchronize()
            self.seconds[name] += start.elapsed_time(end) / 1000
        taken, self.seconds, self._events = dict(self.seconds), defaultdict(float), []
        return taken


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: the most memory tensors have held; CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class Every:
    """`due()` is true at most once per `seconds` (at the first call, and then whenever that
    long has passed since it last was): for readings that need not be taken every step."""

    def __init__(self, seconds: float):
        self.seconds, self.last = seconds, -float("inf")

    def due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True


class PeakMemory:
    """`peak_memory_mb`, read at most once per `every_s` on CPU: getrusage sums over every
    thread of the process, and with gloo's threads running on the other cores it took ~40 us
    a call in a 2-rank run here (1 us in a quiet process), ~1% of a small model's step."""

    def __init__(self, device: torch.device, every_s: float = 1.0):
        self.device, self.every, self.last = device, Every(every_s), 0.0

    def read(self) -> float:
        if self.device.type != "cpu" or self.every.due():
            self.last = peak_memory_mb(self.device)
        return self.last


class GpuReadings:
    """Utilisation, memory, power and temperature of this worker's GPU through NVML
    (nvidia-ml-py); no readings where there is no GPU or no NVML. Read at most once per
    `every_s` (the sensors themselves update about that often): steps in between repeat
    the last reading rather than add four driver calls to every step."""

    FIELDS = tuple(GpuReading)

    def __init__(self, device: torch.device, every_s: float = 1.0):
        self.handle = None
        self.every, self.last = Every(every_s), {}
        if device.type != "cuda":
            return
        try:
            # deferred: pynvml exists only where NVIDIA's driver library does; CPU runs never load it
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(("GPU-" + uuid).encode())
        except Exception:  # no NVML library, or an unknown device: simply no readings
            self.handle = None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def read(self) -> dict[str, float]:
        if self.handle is None or not self.every.due():
            return self.last
        nvml, handle = self.nvml, self.handle
        self.last = {
            GpuReading.UTILIZATION_PCT: float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            GpuReading.MEMORY_USED_MB: nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20,
            GpuReading.POWER_W: nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
            GpuReading.TEMPERATURE_C: float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
        }
        return self.last


class StragglerWatch:
    """A worker whose `measure` (its busy time, or its link's round trip) exceeds `factor`
    x the median of the others (and them by at least `min_gap_s`) for `steps` steps in a
    row is a straggler: one event when it starts, one when it recovers. Ranks without a
    reading (negative) are left out. A measure read less often than every step (a link's
    round trip) counts `steps` of the rank's own readings, so that one slow reading seen
    by many steps is not a streak. Events come as `{"kind": EventKind, **fields}`."""

    def __init__(
        self, factor: float, steps: int, min_gap_s: float, measure: WorkerValue = WorkerValue.BUSY_S
    ):
        self.factor, self.steps, self.min_gap_s, self.measure = factor, steps, min_gap_s, measure
        self.per_reading = measure == WorkerValue.LINK_RTT_S
        self.streaks: dict[int, int] = defaultdict(int)
        self.flagged: set[int] = set()
        self.last: dict[int, float] = {}

    def observe(
        self, step: int, values: list[float], nodes: list[str | None] | None = None
    ) -> list[dict[str, Any]]:
        """`values[rank]` this step; `nodes[rank]`, where known, names the rank's node."""
        measured = {rank: value for rank, value in enumerate(values) if value >= 0}
        if len(measured) < 2:
            return []
        events, medians = [], medians_of_others(list(measured.values()))
        for (rank, seconds), median in zip(measured.items(), medians, strict=True):
            slow = seconds > self.factor * median and seconds - median >= self.min_gap_s
            if self.per_reading and self.last.get(rank) == seconds:
                continue  # the same reading as at the last step
            self.last[rank] = seconds
            self.streaks[rank] = self.streaks[rank] + 1 if slow else 0
            where = {"node": nodes[rank]} if nodes and nodes[rank] else {}
            if slow and self.streaks[rank] == self.steps:
                self.flagged.add(rank)
                events.append(
                    {
                        "kind": EventKind.STRAGGLER,
                        "cause": "link" if self.per_reading else "compute",
                        "rank": rank,
                        **where,
                        "step": step,
                        self.measure.value: round(seconds, 4),
                        "median_s": round(median, 4),
                        "ratio": round(seconds / median, 2) if median > 0 else None,
                        "steps": self.steps,
                    }
                )
            elif not slow and rank in self.flagged:
                self.flagged.discard(rank)
                events.append({"kind": EventKind.STRAGGLER_RECOVERED, "rank": rank, **where, "step": step})
        return events


def medians_of_others(values: list[float]) -> list[float]:
    """For each value, `statistics.median` of all the others, from one sort: a median per
    rank over the rest took 82 ms a step at 1,024 ranks, on every rank."""
    ordered, middle = sorted(values), (len(values) - 1) // 2
    odd_rest = len(values) % 2 == 0

    def kth_of_rest(k: int, gone: int) -> float:  # the rest: `ordered` without index `gone`
        return ordered[k if k < gone else k + 1]

    medians = []
    for value in values:
        gone = bisect.bisect_left(ordered, value)  # any copy of an equal value leaves the same rest
        if odd_rest:
            medians.append(kth_of_rest(middle, gone))
        else:
            medians.append((kth_of_rest(middle - 1, gone) + kth_of_rest(middle, gone)) / 2)
    return medians


def per_rank_series(
    values: list[float], name_of: Callable[[int], str], across: str, up_to: int, keep: Set[int]
) -> dict[str, float]:
    """One value per rank (negatives: no reading) as metrics: each rank's own series up to
    `up_to` ranks; beyond, the spread across ranks (`ACROSS_RANKS` stats under `across`, the
    arg-max rank among them) and the own series of the ranks in `keep` only (stragglers), so
    that the rows per step stay flat however many ranks there are."""
    measured = {rank: value for rank, value in enumerate(values) if value >= 0}
    if len(values) <= up_to:
        return {name_of(rank): value for rank, value in measured.items()}
    metrics = {name_of(rank): measured[rank] for rank in sorted(keep) if rank in measured}
    if measured:
        top = max(measured, key=measured.__getitem__)
        spread = (min(measured.values()), statistics.median(measured.values()), measured[top], float(top))
        metrics.update(
            {across_ranks(across, stat): value for stat, value in zip(ACROSS_RANKS, spread, strict=True)}
        )
    return metrics


def worker_metrics(
    gathered: dict[str, list[float]], gpus: bool, up_to: int = 8, keep: Set[int] = frozenset()
) -> dict[str, float]:
    """Per-worker values (every rank's, from the step's all-reduce: `busy_s`, the link's round
    trip, `peak_mb` and the GPU readings) as MLflow metrics (`per_rank_series`)."""
    busy = gathered[WorkerValue.BUSY_S]
    metrics = {}
    for value in (WorkerValue.BUSY_S, WorkerValue.LINK_RTT_S):
        series = gathered.get(value, [])
        metrics.update(
            per_rank_series(
                series, partial(worker_metric, value=value), f"{WORKER_PREFIX}{value}", up_to, keep
            )
        )
    metrics[Metric.TIME_BUSY_MAX_S] = max(busy)
    metrics[Metric.TIME_BUSY_MEDIAN_S] = statistics.median(busy)
    metrics[Metric.MEMORY_PEAK_MB] = max(gathered["peak_mb"])
    for reading in GpuReadings.FIELDS if gpus else ():
        name_of = partial(gpu_metric, reading=reading)
        metrics.update(per_rank_series(gathered[reading], name_of, f"{GPU_PREFIX}{reading}", up_to, keep))
    return metrics


class RankWatch:
    """What the step's all-reduce tells of every rank: stragglers by busy time and by link
    (`StragglerWatch`), and the per-rank metrics (`per_rank_series`: the flagged ranks keep
    their own series beyond `monitor.per_rank_up_to` ranks)."""

    def __init__(self, monitor: MonitorSpec):
        stragglers, self.up_to = monitor.stragglers, monitor.per_rank_up_to
        self.busy = StragglerWatch(stragglers.factor, stragglers.steps, stragglers.min_gap_s)
        self.links = StragglerWatch(
            stragglers.factor, stragglers.steps, stragglers.link_min_gap_s, WorkerValue.LINK_RTT_S
        )
        self.logged_links: dict[int, float] = {}  # each rank's reading last put in its series

    def observe(self, step: int, gathered: dict[str, list[float]]) -> list[dict[str, Any]]:
        """Straggler events of this step. Every rank sees the same gathered values and so
        records the same events: a rank-0-only event would make rank 0 alone decide to report,
        and ray.train.report is a barrier."""
        nodes = [address_of(number) for number in gathered[LINK_ADDRESS]]
        return [
            *self.busy.observe(step, gathered[WorkerValue.BUSY_S], nodes),
            *self.links.observe(step, gathered[WorkerValue.LINK_RTT_S], nodes),
        ]

    def step_metrics(self, gathered: dict[str, list[float]], gpus: bool) -> dict[str, float]:
        shown = {**gathered, WorkerValue.LINK_RTT_S: self._new_link_readings(gathered)}
        return worker_metrics(shown, gpus, self.up_to, self.busy.flagged | self.links.flagged)

    def _new_link_readings(self, gathered: dict[str, list[float]]) -> list[float]:
        """A link is timed every few seconds, not every step: a rank's round trip is a point
        in its series at the step its reading came, not again at every step that still
        carries it. Beyond `up_to` ranks, the spread over every rank's latest reading is a
        point whenever any rank has a new one."""
        readings = gathered.get(WorkerValue.LINK_RTT_S, [])
        logged = self.logged_links
        new = {rank for rank, value in enumerate(readings) if value >= 0 and logged.get(rank) != value}
        logged.update({rank: readings[rank] for rank in new})
        if len(readings) > self.up_to:
            return list(readings) if new else [NO_READING] * len(readings)
        return [value if rank in new else NO_READING for rank, value in enumerate(readings)]

    def epoch_metrics(self, gathered: dict[str, list[float]]) -> dict[str, float]:
        return data_metrics(gathered, self.up_to, self.busy.flagged | self.links.flagged)


def read_counts_per_rank(counts: ReadCounts) -> dict[str, float]:
    """This rank's reading in the current epoch, as per-rank values for the step's all-reduce."""
    return {data_metric(count): float(getattr(counts, count)) for count in DataCount}


def data_metrics(
    gathered: dict[str, list[float]], up_to: int = 8, keep: Set[int] = frozenset()
) -> dict[str, float]:
    """Every rank's reading of the epoch (`read_counts_per_rank`, gathered; `per_rank_series`),
    and the sums."""
    metrics = {}
    for count in DataCount:
        per_rank = gathered[data_metric(count)]
        name_of = partial(data_metric, count)
        metrics.update(per_rank_series(per_rank, name_of, data_metric(count), up_to, keep))
        metrics[data_metric(count)] = sum(per_rank)
    return metrics
