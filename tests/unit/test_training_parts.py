"""Worker parts that need no Ray: schedule, accumulation, checkpoint round trip."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shoal.models import build_model
from shoal.spec.schema import OptimizerSpec, ScheduleSpec, TrainSpec, Workload
from shoal.worker.batching import accumulation_steps, global_batch_size, planned_steps
from shoal.worker.checkpoint import format as checkpoint
from shoal.worker.optim import build_optimizer, build_scheduler, lr_multiplier
from tests.unit.parallel_harness import free_port

SCHEDULE = ScheduleSpec(warmup_steps=10, decay="cosine", min_lr_ratio=0.1)
OPTIMIZER = OptimizerSpec(name="adamw", lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), momentum=0.9)


def test_warmup_then_cosine_to_the_floor() -> None:
    values = [lr_multiplier(s, 110, SCHEDULE) for s in range(111)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[10] == pytest.approx(1.0)
    assert values[60] == pytest.approx(0.55)
    assert values[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[10:], values[11:], strict=False))


def test_linear_and_constant_decay() -> None:
    linear = SCHEDULE.model_copy(update={"decay": "linear", "warmup_steps": 0})
    assert lr_multiplier(50, 100, linear) == pytest.approx(0.55)
    assert lr_multiplier(77, 100, SCHEDULE.model_copy(update={"decay": "constant"})) == 1.0


def test_accumulation_keeps_the_global_batch() -> None:
    assert accumulation_steps(128, 64, 2) == 1
    assert accumulation_steps(512, 64, 2) == 4
    assert accumulation_steps(512, 64, 1) == 8
    with pytest.raises(ValueError, match="not a multiple"):
        accumulation_steps(384, 64, 4)


def _workload(workers: object, global_batch: int | None = None) -> Workload:
    return Workload.model_validate(
        {
            "name": "batching",
            "model": {"family": "mlp"},
            "data": {"builtin": "digits", "batch_size": 16},
            "train": {"max_steps": 10, "global_batch_size": global_batch},
            "scaling": {"workers": workers},
        }
    )


def test_global_batch_defaults_to_the_largest_world() -> None:
    assert global_batch_size(_workload(2)) == 32
    assert global_batch_size(_workload({"min": 1, "max": 4})) == 64
    assert global_batch_size(_workload({"min": 1, "max": 4}, global_batch=96)) == 96


def test_planned_steps_from_epochs() -> None:
    train = TrainSpec(epochs=3, global_batch_size=256)
    # 1437 rows -> 5 whole global batches of 256 per epoch (the short tail is dropped)
    assert planned_steps(train, 1437, 256) == 15
    assert planned_steps(TrainSpec(max_steps=7, global_batch_size=256), None, 256) == 7


def test_weight_decay_skips_biases() -> None:
    model = build_model({"family": "mlp", "args": {"hidden": 8}})
    optimizer = build_optimizer(model, OPTIMIZER)
    decayed, plain = optimizer.param_groups
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in plain["params"])
    assert plain["weight_decay"] == 0.0


def _train_a_little(model, optimizer, scheduler, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.rand(8, 64)).logsumexp(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def test_checkpoint_round_trip_restores_everything(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model({"family": "mlp", "args": {"hidden": 16}})
    optimizer = build_optimizer(model, OPTIMIZER)
    scheduler = build_scheduler(optimizer, 100, SCHEDULE)
    _train_a_little(model, optimizer, scheduler, 5)
    state = {"position": {"step": 5}, "world_size": 1, "scheduler": scheduler.state_dict()}
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    assert checkpoint.save(tmp_path, [model], [optimizer], rank=0, trainer_state=state) is None
    assert checkpoint.verify(tmp_path) is None
    expected_draws = (random.random(), np.random.rand(), torch.rand(1).item())

    torch.manual_seed(99)
    fresh = build_model({"family": "mlp", "args": {"hidden": 16}})
    fresh_optimizer = build_optimizer(fresh, OPTIMIZER)
    fresh_scheduler = build_scheduler(fresh_optimizer, 100, SCHEDULE)
    parts = [fresh], [fresh_optimizer], [fresh_scheduler]
    restored, rng_restored = checkpoint.restore(tmp_path, *parts, rank=0)

    assert restored["position"] == {"step": 5} and rng_restored
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert fresh_scheduler.last_epoch == 5 and fresh_scheduler.get_last_lr() == scheduler.get_last_lr()
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    for key in saved:
        assert torch.equal(saved[key]["exp_avg"], loaded[key]["exp_avg"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected_draws
    # Both continue identically from here.
    torch.manual_seed(5)
    _train_a_little(model, optimizer, scheduler, 3)
    torch.manual_seed(5)
    _train_a_little(fresh, fresh_optimizer, fresh_scheduler, 3)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_sgd_with_momentum() -> None:
    model = build_model({"family": "mlp", "args": {"hidden": 8}})
    optimizer = build_optimizer(model, OPTIMIZER.model_copy(update={"name": "sgd", "momentum": 0.8}))
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.param_groups[0]["momentum"] == 0.8 and optimizer.param_groups[0]["lr"] == 1e-2


def _kernels(optimizer: torch.optim.Optimizer) -> set[tuple[object, object]]:
    return {(bool(group["fused"]), bool(group["foreach"])) for group in optimizer.param_groups}


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_auto_picks_the_fused_kernel_and_each_choice_is_what_torch_is_asked_for(name: str) -> None:
    model = build_model({"family": "mlp", "args": {"hidden": 8}})
    spec = OPTIMIZER.model_copy(update={"name": name})
    assert _kernels(build_optimizer(model, spec)) == {(True, False)}
    chosen = {
        implementation: _kernels(
            build_optimizer(model, spec.model_copy(update={"implementation": implementation}))
        )
        for implementation in ("fused", "foreach", "for-loop")
    }
    assert chosen["fused"] == {(True, False)} and chosen["foreach"] == {(False, True)}
    assert chosen["for-loop"] == {(False, False)}


def test_sparse_gradients_keep_torchs_default_kernel() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    optimizer = build_optimizer(model, OPTIMIZER.model_copy(update={"name": "sgd", "weight_decay": 0.0}))
    assert _kernels(optimizer) == {(False, False)}
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()  # torch's fused SGD would refuse the embedding's sparse gradient


def _tp_split_layer(rank: int, port: int, out: Path) -> None:
    """One rank: a Linear split for tp (its weight a DTensor) before a plain one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    steps = {}
    for choice in ("auto", "fused", "foreach"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        parallelize_module(model, mesh, {"0": ColwiseParallel(use_local_output=True)})
        optimizer = build_optimizer(model, OPTIMIZER.model_copy(update={"implementation": choice}))
        model(torch.randn(3, 4)).sum().backward()
        try:
            optimizer.step()
            steps[choice] = sorted(_kernels(optimizer))
        except Exception as exc:  # what a kernel of one tensor kind per call says
            steps[choice] = f"{type(exc).__name__}: {exc}"[:200]
    (out / "steps.json").write_text(json.dumps(steps))
    dist.destroy_process_group()


def test_tp_split_parameters_step_with_the_for_loop_under_auto(tmp_path: Path) -> None:
    """With tp, split layers are DTensors and the rest plain tensors: torch's fused and
    foreach kernels take one kind per call, so `auto` takes the for-loop (refused before
    launch when fused or foreach is asked for: test_spec.py)."""
    mp.start_processes(_tp_split_layer, args=(free_port(), tmp_path), nprocs=1, join=True)
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert steps["auto"] == [[False, False]]
    assert "mixed torch.Tensor and DTensor" in steps["fused"], steps
    assert "mixed torch.Tensor and DTensor" in steps["foreach"], steps


def test_the_fused_kernel_trains_as_torchs_default_does() -> None:
    """Same start, same batches: the fused AdamW and torch's for-loop end within float rounding."""
    trained = []
    for implementation in ("fused", "for-loop"):
        torch.manual_seed(0)
        model = build_model({"family": "mlp", "args": {"hidden": 16}})
        optimizer = build_optimizer(model, OPTIMIZER.model_copy(update={"implementation": implementation}))
        torch.manual_seed(1)
        _train_a_little(model, optimizer, build_scheduler(optimizer, 100, SCHEDULE), 20)
        trained.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    fused, loop = trained
    assert not torch.equal(fused, torch.zeros_like(fused))
    torch.testing.assert_close(fused, loop, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_of_one_kernel_resumes_under_another(tmp_path: Path) -> None:
    """Fused AdamW keeps its step count as a tensor on the parameters' device: a checkpoint
    written by torch's default kernel restores into it and trains on alike."""
    torch.manual_seed(0)
    model = build_model({"family": "mlp", "args": {"hidden": 16}})
    optimizer = build_optimizer(model, OPTIMIZER.model_copy(update={"implementation": "for-loop"}))
    scheduler = build_scheduler(optimizer, 100, SCHEDULE)
    _train_a_little(model, optimizer, scheduler, 4)
    state = {"position": {"step": 4}, "world_size": 1, "scheduler": scheduler.state_dict()}
    checkpoint.save(tmp_path, [model], [optimizer], rank=0, trainer_state=state)
    fresh = build_model({"family": "mlp", "args": {"hidden": 16}})
    fused = build_optimizer(fresh, OPTIMIZER)
    fresh_scheduler = build_scheduler(fused, 100, SCHEDULE)
    checkpoint.restore(tmp_path, [fresh], [fused], [fresh_scheduler], rank=0)
    assert _kernels(fused) == {(True, False)}
    torch.manual_seed(5)
    _train_a_little(model, optimizer, scheduler, 3)
    torch.manual_seed(5)
    _train_a_little(fresh, fused, fresh_scheduler, 3)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _saved(tmp_path: Path) -> Path:
    model = build_model({"family": "mlp", "args": {"hidden": 8}})
    optimizer = build_optimizer(model, OPTIMIZER)
    scheduler = build_scheduler(optimizer, 10, SCHEDULE)
    state = {"position": {}, "world_size": 1, "scheduler": scheduler.state_dict()}
    checkpoint.save(tmp_path, [model], [optimizer], rank=0, trainer_state=state)
    return tmp_path


def test_verify_rejects_a_corrupt_or_incomplete_checkpoint(tmp_path: Path) -> None:
    directory = _saved(tmp_path)
    shard = next(directory.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    shard.write_bytes(bytes(data))
    assert checkpoint.verify(directory) == f"{shard.name} does not match its manifest (size or CRC32 differ)"
    (directory / "manifest-rank0.json").unlink()
    assert checkpoint.verify(directory) == "rank 0 of 1 never finished writing (no manifest-rank0.json)"
    (directory / "trainer_state.json").unlink()
    assert checkpoint.verify(directory) == "trainer_state.json is missing"
