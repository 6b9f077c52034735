"""Parallel degrees and the rules on them, without torch (spec, plan and worker use it).

Four degrees whose product is the world size, outermost first:
    pp (pipeline stages) x dp_replicate x dp_shard (FSDP) x tp (tensor parallel).
A strategy name is shorthand for degrees; explicit degrees may use -1 once to
take whatever is left of the world. worker/parallel/dims.py builds the torch
device mesh on these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from shoal.errors import ShoalError

DEGREES = ("pp", "dp_replicate", "dp_shard", "tp")


class DegreeError(ShoalError, ValueError):
    """Degrees that cannot make the world size."""


def _named_degrees(strategy: str, world: int, given: dict[str, int]) -> dict[str, int]:
    if strategy == "ddp":
        return {"dp_replicate": -1}
    if strategy == "fsdp":
        return {"dp_shard": -1}
    if strategy == "hsdp":  # shard inside groups, replicate across them
        shard = given.get("dp_shard") or (world // 2 if world >= 4 and world % 2 == 0 else world)
        return {"dp_shard": shard, "dp_replicate": -1}
    if strategy == "tp":
        return {"tp": -1}
    if strategy == "pp":
        return {"pp": -1}
    # hybrid: the degrees given, the rest sharded data parallel
    if sum(1 for d in given.values() if d not in (None, 1)) < 1:
        raise DegreeError("strategy 'hybrid' needs at least one of tp or pp set (e.g. tp: 2)")
    return {} if "dp_shard" in given or -1 in given.values() else {"dp_shard": -1}


def resolve_degrees(parallel: Mapping[str, Any], world: int) -> dict[str, int]:
    """The four degrees for this world size (from the spec's `parallel` section: a strategy,
    explicit degrees or both), or a DegreeError saying why not."""
    given = {k: parallel[k] for k in DEGREES if parallel.get(k) is not None}
    for key, value in given.items():
        if value == 0 or value < -1:
            raise DegreeError(f"parallel.{key} must be a positive degree or -1 (got {value})")
    strategy = parallel.get("strategy") or ("hybrid" if given else "ddp")
    degrees = {k: 1 for k in DEGREES}
    degrees.update(_named_degrees(strategy, world, given))
    degrees.update(given)
    fill = [k for k, v in degrees.items() if v == -1]
    if len(fill) > 1:
        raise DegreeError(f"only one degree may be -1 (got {', '.join(fill)})")
    fixed = math.prod(value for value in degrees.values() if value != -1)
    if fill:
        if world % fixed:
            raise DegreeError(
                f"{show_degrees(degrees)} cannot split {world} workers ({world} is not a multiple of "
                f"{fixed}; {fill[0]} would take the rest)"
            )
        degrees[fill[0]] = world // fixed
    elif fixed != world:
        raise DegreeError(f"{show_degrees(degrees)} makes {fixed} ranks but there are {world} workers")
    return degrees


def show_degrees(degrees: Mapping[str, int], none: str = "all degrees 1") -> str:
    """'pp=2 x tp=2': the degrees above 1, outermost first; `none` when there are none."""
    return " x ".join(f"{k}={degrees[k]}" for k in DEGREES if degrees.get(k, 1) not in (1, -1)) or none


def stages_per_rank(schedule: str) -> int:
    """Pipeline stages each pp rank holds under a schedule (interleaved 1F1B: two)."""
    return 2 if schedule == "interleaved_1f1b" else 1


def layer_ranges(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible runs of layers; earlier stages get the extra ones."""
    base, extra = divmod(n_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


@dataclass(frozen=True, kw_only=True)
class Degrees:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @classmethod
    def resolve(cls, parallel: Mapping[str, Any], world: int) -> Self:
        return cls(**resolve_degrees(parallel, world))

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """Ranks that share one data-parallel slot (and so one batch)."""
        return self.pp * self.tp

    @property
    def uses_fsdp(self) -> bool:
        # With tp or pp, plain replication is done by FSDP over a (replicate, 1) mesh.
        return self.dp_shard > 1 or (self.dp_replicate > 1 and self.model_parallel > 1)

    @property
    def uses_ddp(self) -> bool:
        return self.dp_replicate > 1 and not self.uses_fsdp

    def pipeline_stages(self, schedule: str) -> int:
        """Pipeline stages in all (1 without pipeline parallelism)."""
        return self.pp * stages_per_rank(schedule) if self.pp > 1 else 1

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in DEGREES}

    def describe(self, none: str = "all degrees 1") -> str:
        return show_degrees(self.as_dict(), none)
