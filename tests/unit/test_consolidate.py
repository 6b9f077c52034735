"""A DCP checkpoint written by 2 FSDP ranks, read back in one process without a process group."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from shoal.worker.checkpoint import format as checkpoint_format
from shoal.worker.checkpoint.consolidate import (
    CheckpointError,
    checkpoint_path,
    consolidate,
    consolidated_model,
    read_model_state,
)
from tests.unit.parallel_harness import gpt_spec, run


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, object]:
    """3 steps on 2 FSDP ranks, saved as checkpoint-00000003 of a run directory."""
    root = tmp_path_factory.mktemp("fsdp")
    directory = root / "run" / checkpoint_format.checkpoint_name(3)
    directory.mkdir(parents=True)
    spec = replace(gpt_spec({"strategy": "fsdp"}), checkpoint_io={"mode": "save", "dir": str(directory)})
    saver = run(spec, 2, root / "ranks")[0]
    return root / "run", saver["weights"], spec.workload


def test_two_fsdp_ranks_consolidate_to_the_full_weights(fsdp_checkpoint: tuple) -> None:
    run_dir, weights, workload = fsdp_checkpoint
    found = consolidate(pafs.LocalFileSystem(), str(run_dir))
    assert found.step == 3 and found.checkpoint.endswith("checkpoint-00000003")
    assert found.state_dict.keys() == weights.keys()
    for name, tensor in weights.items():
        assert torch.equal(found.state_dict[name], tensor), name
    model = consolidated_model(workload, found)
    tokens = torch.randint(0, 256, (3, 9))
    with torch.no_grad():
        assert model(tokens).shape == (3, 9, 256)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())


def test_a_missing_step_names_the_steps_there(fsdp_checkpoint: tuple) -> None:
    run_dir = fsdp_checkpoint[0]
    with pytest.raises(CheckpointError, match=r"no checkpoint at step 7 .*\(steps: 3\)"):
        checkpoint_path(pafs.LocalFileSystem(), str(run_dir), 7)
    with pytest.raises(CheckpointError, match="no checkpoints under"):
        checkpoint_path(pafs.LocalFileSystem(), str(run_dir / "nothing"))


def test_an_unsealed_checkpoint_is_refused(fsdp_checkpoint: tuple, tmp_path: Path) -> None:
    copy = tmp_path / "checkpoint-00000003"
    shutil.copytree(fsdp_checkpoint[0] / "checkpoint-00000003", copy)
    (copy / "manifest-rank1.json").unlink()
    with pytest.raises(CheckpointError, match="rank 1 of 2 never finished writing"):
        read_model_state(copy)


def test_a_checkpoint_behind_another_filesystem_is_copied_then_read(fsdp_checkpoint: tuple) -> None:
    """Object storage's path: any pyarrow filesystem that is not the local one (here a subtree
    view of a local directory, as s3:// is of a bucket) is copied to a temporary directory."""
    run_dir, weights, _ = fsdp_checkpoint
    subtree = pafs.SubTreeFileSystem(str(run_dir.parent), pafs.LocalFileSystem())
    found = consolidate(subtree, "run", step=3)
    assert found.checkpoint == "run/checkpoint-00000003"
    assert all(torch.equal(found.state_dict[k], v) for k, v in weights.items())
