"""The torch device mesh of a set of parallel degrees (the degrees and their rules:
shoal/degrees.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shoal.degrees import DEGREES, Degrees


@dataclass(frozen=True, kw_only=True)
class ParallelDims(Degrees):
    @classmethod
    def from_spec(cls, parallel: dict[str, Any], world: int) -> Self:
        return cls.resolve(parallel, world)

    def build_mesh(self, device_type: str) -> Any:
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
