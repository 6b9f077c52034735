"""Parallel degrees and the device mesh they make.

Four degrees whose product is the world size, outermost first:
    pp (pipeline stages) x dp_replicate x dp_shard (FSDP) x tp (tensor parallel).
A strategy name is shorthand for degrees; explicit degrees may use -1 once to
take whatever is left of the world.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

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


def resolve_degrees(parallel: dict[str, Any], world: int) -> dict[str, int]:
    """The four degrees for this world size, or a DegreeError saying why not."""
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
                f"{_show(degrees)} cannot split {world} workers ({world} is not a multiple of {fixed}; "
                f"{fill[0]} would take the rest)"
            )
        degrees[fill[0]] = world // fixed
    elif fixed != world:
        raise DegreeError(f"{_show(degrees)} makes {fixed} ranks but there are {world} workers")
    return degrees


def _show(degrees: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in degrees.items() if v not in (1, -1)) or "all degrees 1"


@dataclass
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    world: int

    @classmethod
    def from_spec(cls, parallel: dict[str, Any], world: int) -> ParallelDims:
        return cls(**resolve_degrees(parallel, world), world=world)

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

    def build_mesh(self, device_type: str) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            device_type, (self.pp, self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=DEGREES
        )

    def model_parallel_groups(self, mesh: Any) -> Any:
        """The process group of this rank's (pp x tp) slot; every rank creates every group."""
        layout = mesh.mesh  # [pp, dp_replicate, dp_shard, tp] of global ranks
        mine = None
        for r in range(self.dp_replicate):
            for s in range(self.dp_shard):
                ranks = layout[:, r, s, :].flatten().tolist()
                group = dist.new_group(ranks) if self.model_parallel > 1 else None
                if dist.get_rank() in ranks:
                    mine = (group, ranks)
        return mine


def local_numel(tensor: torch.Tensor) -> int:
    """Elements this rank holds (a DTensor's local shard, else the tensor)."""
    return tensor.to_local().numel() if hasattr(tensor, "to_local") else tensor.numel()
