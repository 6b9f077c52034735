"""A checkpoint written by N workers resumes on M: model and optimizer state equal after load.

The real Engine on gloo ranks (no Ray) trains 3 steps on 2 ranks and saves through
shoal's checkpoint module; 1 and 3 ranks load it and gather the full state back.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shoal.worker.checkpoint import format as checkpoint_format
from tests.unit.parallel_harness import gpt_spec, run


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoint_from_two_ranks_loads_on_one_and_three(strategy: str, tmp_path: Path) -> None:
    saved_dir = tmp_path / "ckpt"
    saved_dir.mkdir()
    spec = gpt_spec({"strategy": strategy})
    saving = replace(spec, checkpoint_io={"mode": "save", "dir": str(saved_dir)})
    saver = run(saving, 2, tmp_path / "saver")[0]
    assert checkpoint_format.verify(saved_dir) is None  # both ranks sealed their shards
    assert any(torch.is_tensor(v) and "momentum_buffer" in k for k, v in saver["optim"].items())
    for world in (1, 3):
        loading = replace(spec, checkpoint_io={"mode": "load", "dir": str(saved_dir)})
        loaded = run(loading, world, tmp_path / f"m{world}")
        for rank_state in loaded:
            assert rank_state["weights"].keys() == saver["weights"].keys()
            for name, tensor in saver["weights"].items():
                assert torch.equal(rank_state["weights"][name], tensor), (world, name)
            assert rank_state["optim"].keys() == saver["optim"].keys()
            for key, value in saver["optim"].items():
                if key.endswith((".fused", ".foreach")):  # the loading run's own kernel (worker/optim.py)
                    continue
                other = rank_state["optim"][key]
                assert torch.equal(other, value) if torch.is_tensor(value) else other == value, (world, key)
            assert rank_state["lr"] == saver["lr"]
