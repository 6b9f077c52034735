"""The planner: estimates against memory measured by torch's MemTracker during real
training steps on CPU, strategy choice, interconnect warnings, --write."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from shoal.plan.catalog import CATALOG, gpu_for_device
from shoal.plan.memory import Layout, estimate
from shoal.plan.planner import PlanError, make_plan, model_cost, recommended_values, training_of
from shoal.spec.schema import Workload
from shoal.spec.sweep import with_values
from shoal.worker.engine import Engine

GPT = {"family": "gpt", "args": {"n_layers": 4, "d_model": 128, "n_heads": 4, "seq_len": 128}}


def workload(model: dict[str, Any], batch: int, **train: Any) -> Workload:
    data = {"builtin": "pytext" if model["family"] == "gpt" else "digits", "batch_size": batch}
    return Workload.model_validate(
        {"name": "plan", "model": model, "data": data, "train": {"max_steps": 10, **train}}
    )


def synthetic_batch(w: Workload, rows: int) -> dict[str, torch.Tensor]:
    if w.model.family == "gpt":
        return {"tokens": torch.randint(0, 256, (rows, w.model.args["seq_len"] + 1))}
    return {"x": torch.randn(rows, 64), "y": torch.randint(0, 10, (rows,))}


def measured_peak(w: Workload) -> float:
    """Peak bytes of tensors during three real optimizer steps (the first one has no optimizer
    state yet), as torch's MemTracker counts them."""
    task = "lm" if w.model.family == "gpt" else "classify"
    engine = Engine(w, task, 1, torch.device("cpu"), total_steps=10, accumulation=1)
    batch = synthetic_batch(w, w.data.batch_size)
    tracker = MemTracker()
    tracker.track_external(*engine.parts, *engine.optimizers)
    with tracker:
        for _ in range(3):
            tracker.reset_mod_stats()
            engine.forward_backward([batch])
            engine.optimizer_step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


CASES = {
    "gpt": (GPT, 32, {}),
    "gpt-full-checkpointing": (GPT, 32, {"activation_checkpointing": "full"}),
    "gpt-selective-checkpointing": (GPT, 32, {"activation_checkpointing": "selective"}),
    "gpt-bf16": (GPT, 32, {"precision": "bf16"}),
    "gpt-sgd": (GPT, 16, {"optimizer": {"name": "sgd", "lr": 0.1}}),
    "mlp": ({"family": "mlp", "args": {"hidden": 512, "layers": 3}}, 64, {}),
    "cnn": ({"family": "cnn", "args": {"channels": 32}}, 64, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_estimate_within_25_percent_of_measured_peak(case: str) -> None:
    model, batch, train = CASES[case]
    w = workload(model, batch, **train)
    cost = model_cost(w, w.train.precision)
    predicted = estimate(cost, Layout("ddp"), training_of(w), batch).peak
    measured = measured_peak(w)
    print(f"{case}: estimate {predicted / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB")
    assert 0.75 * measured <= predicted <= 1.25 * measured


def test_checkpointing_and_sharding_shrink_the_estimate() -> None:
    w = workload(GPT, 32)
    cost = model_cost(w, "fp32")
    plain = estimate(cost, Layout("ddp"), training_of(w), 32)
    full = estimate(cost, Layout("ddp"), training_of(w, "full"), 32)
    sharded = estimate(cost, Layout("fsdp", dp_shard=4), training_of(w), 32)
    tensor = estimate(cost, Layout("hybrid", tp=4), training_of(w), 32)
    assert full.activations < plain.activations / 2
    assert sharded.optimizer == pytest.approx(plain.optimizer / 4)
    assert tensor.activations < plain.activations and tensor.weights < plain.weights


def big_gpt(layers: int, width: int, batch: int, seq: int = 2048) -> Workload:
    args = {"n_layers": layers, "d_model": width, "n_heads": 32, "seq_len": seq, "vocab_size": 32000}
    return workload({"family": "gpt", "args": args}, batch, global_batch_size=batch * 8, precision="bf16")


def test_small_model_gets_ddp_with_the_largest_micro_batch() -> None:
    plan = make_plan(workload(GPT, 32, global_batch_size=256), "h100-80gb", 8)
    assert plan.choice is not None and plan.choice.layout.strategy == "ddp"
    assert (plan.choice.micro, plan.choice.accumulation) == (32, 1)


def test_a_7b_model_needs_sharding_and_warns_about_tp_on_l40s() -> None:
    w = big_gpt(32, 4096, 8)  # ~6.7B parameters
    plan = make_plan(w, "h100-80gb", 8)
    by_name = {o.layout.describe(): o for o in plan.options}
    assert not by_name["dp_replicate=8"].fits  # 16 bytes/parameter of state alone is > 80 GB
    assert plan.choice is not None and plan.choice.layout.dp_shard == 8
    l40s = make_plan(w, "l40s-48gb", 8)
    tp = [o for o in l40s.options if o.layout.tp > 1]
    assert tp and all("no NVLink" in warning for o in tp if o.fits for warning in o.warnings)


def test_fsdp_across_nodes_without_infiniband_is_flagged() -> None:
    plan = make_plan(big_gpt(32, 4096, 8), "h100-80gb", 16, nodes=2, interconnect="nvlink")
    fsdp = next(o for o in plan.options if o.layout.strategy == "fsdp")
    assert any("across nodes" in warning for warning in fsdp.warnings)
    assert plan.choice is not None and plan.choice.layout.strategy == "hsdp"


def test_write_applies_the_choice_and_validates() -> None:
    w = big_gpt(32, 4096, 8)
    w.parallel.strategy, w.parallel.tp, w.parallel.dp_shard = "hybrid", 2, 4  # replaced by the plan's
    plan = make_plan(w, "h200-141gb", 8)
    assert plan.choice is not None and plan.choice.layout.tp == 1
    written = Workload.model_validate(with_values(w.resolved(), recommended_values(plan)))
    assert written.scaling.workers == 8 and written.scaling.gpus_per_worker == 1
    assert written.train.global_batch_size == w.train.global_batch_size
    assert written.parallel.strategy == plan.choice.layout.strategy == "fsdp"
    assert (written.parallel.tp, written.parallel.dp_shard) == (None, None)


@pytest.mark.parametrize(
    ("gpu", "gpus", "nodes", "link", "message"),
    [
        ("tpu-v5", 8, 1, None, "not in the catalog"),
        ("h100-80gb", 6, 4, None, "multiple of --nodes"),
        ("l40s-48gb", 8, 1, "nvlink", "has no NVLink"),
    ],
)
def test_bad_arguments_are_named(gpu: str, gpus: int, nodes: int, link: str | None, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        make_plan(workload(GPT, 32), gpu, gpus, nodes, link)


def test_catalog_matches_cuda_device_names() -> None:
    assert gpu_for_device("NVIDIA H100 80GB HBM3") is CATALOG["h100-80gb"]
    assert gpu_for_device("NVIDIA H200") is CATALOG["h200-141gb"]
    assert gpu_for_device("NVIDIA L40S") is CATALOG["l40s-48gb"]
    assert gpu_for_device("NVIDIA A100-SXM4-80GB") is CATALOG["a100-80gb"]
    assert gpu_for_device("cpu") is None


def test_plan_command_writes_a_workload_that_validates(tmp_path, capsys) -> None:
    from shoal.cli import main
    from shoal.spec import load

    source = tmp_path / "w.yaml"
    source.write_text(
        "name: big\n"
        "model: {family: gpt, args: {n_layers: 32, d_model: 4096, n_heads: 32, seq_len: 2048,\n"
        "                            vocab_size: 32000}}\n"
        "data: {builtin: pytext, batch_size: 8}\n"
        "train: {max_steps: 10, global_batch_size: 64, precision: bf16}\n"
    )
    out = tmp_path / "planned.yaml"
    code = main(["plan", str(source), "--gpu", "h100-80gb", "--gpus", "8", "--write", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "recommended: fsdp" in printed and "by precision" in printed
    planned = load(out).workload
    assert planned.parallel.strategy == "fsdp" and planned.scaling.workers == 8
    assert planned.train.global_batch_size == 64


def test_plan_command_names_a_bad_argument(tmp_path, capsys) -> None:
    from shoal.cli import main

    source = tmp_path / "w.yaml"
    source.write_text("name: w\nmodel: {family: mlp}\ndata: {builtin: digits}\ntrain: {max_steps: 1}\n")
    assert main(["plan", str(source), "--gpu", "l40s-48gb", "--gpus", "2", "--interconnect", "nvlink"]) == 2
    assert "has no NVLink" in capsys.readouterr().err


def test_doctor_reports_each_check(tmp_path, capsys, monkeypatch) -> None:
    from shoal.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["doctor"])
    printed = capsys.readouterr().out
    for name in ("python", "torch", "ray", "mlflow", "cuda", "nccl", "topology", "infiniband", "checkpoints"):
        assert name in printed
    assert code == 0 and "ready" in printed
    code = main(["doctor", "--address", "127.0.0.1:1"])
    assert code == 1 and "1 check(s) failed: ray" in capsys.readouterr().out
    assert not (tmp_path / "mlflow.db").exists()  # checking the default store does not create it
