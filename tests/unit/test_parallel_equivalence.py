"""Every strategy, through the real worker Engine on gloo ranks, against one process.

A small GPT trains 3 steps on the same global batches (8 x 17 tokens) from one
seed: per-step losses and final weights must match the single-process run.
Tolerances: fp32 within 1e-5 (losses) and 1e-6 (weights); bf16 within 3e-2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.parallel_harness import gpt_spec, run

FP32_LOSS, FP32_WEIGHTS, BF16 = 1e-5, 1e-6, 3e-2

CASES = {
    "ddp": ({"strategy": "ddp"}, 2, 1),
    "fsdp+accumulation": ({"strategy": "fsdp"}, 2, 2),
    "hsdp": ({"strategy": "hsdp"}, 4, 1),
    "tp": ({"strategy": "tp"}, 2, 1),
    "pp-gpipe": ({"strategy": "pp", "pp_schedule": "gpipe", "microbatches": 2}, 2, 1),
    "pp-1f1b": ({"strategy": "pp", "pp_schedule": "1f1b", "microbatches": 4}, 2, 1),
    "pp-interleaved": ({"strategy": "pp", "pp_schedule": "interleaved_1f1b", "microbatches": 4}, 2, 1),
    "fsdp-x-tp": ({"dp_shard": 2, "tp": 2}, 4, 1),
}


AC_CASES = {
    "full-ac-fsdp": ({"strategy": "fsdp"}, 2, "full"),
    "selective-ac-tp": ({"strategy": "tp"}, 2, "selective"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run(gpt_spec({}), 1, tmp_path_factory.mktemp("reference"))[0]


def merged_weights(outputs: list[dict]) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for output in outputs:  # pipeline stages hold different layers; replicas hold the same
        weights.update(output["weights"])
    return weights


def max_weight_difference(outputs: list[dict], reference: dict) -> float:
    weights = merged_weights(outputs)
    assert set(weights) == set(reference["weights"])
    return max((weights[k].float() - v.float()).abs().max().item() for k, v in reference["weights"].items())


@pytest.mark.parametrize("name", list(CASES))
def test_strategy_matches_single_process(name: str, reference: dict, tmp_path: Path) -> None:
    parallel, world, accumulation = CASES[name]
    outputs = run(gpt_spec(parallel, accumulation=accumulation), world, tmp_path)
    for output in outputs:
        assert output["losses"] == pytest.approx(reference["losses"], abs=FP32_LOSS)
    difference = max_weight_difference(outputs, reference)
    print(f"{name}: max |weight - reference| = {difference:.2e}")
    assert difference < FP32_WEIGHTS
    # plain DDP on CPU: every step's stats rode its gradient all-reduce (worker/parallel/stats_ride.py)
    assert [o["stats_carried"] for o in outputs] == [3 if name == "ddp" else 0] * world


def test_bf16_fsdp_is_close_to_fp32(reference: dict, tmp_path: Path) -> None:
    outputs = run(gpt_spec({"strategy": "fsdp"}, precision="bf16"), 2, tmp_path)
    assert outputs[0]["losses"] == pytest.approx(reference["losses"], abs=BF16)
    difference = max_weight_difference(outputs, reference)
    print(f"bf16 fsdp: max |weight - reference| = {difference:.2e}")
    assert difference < BF16


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_keeps_one_nth_per_rank(world: int, tmp_path: Path) -> None:
    outputs = run(gpt_spec({"strategy": "fsdp"}), world, tmp_path)
    total = outputs[0]["parameters"]
    for output in outputs:
        # Sharding pads dim 0 to a multiple of N, so a shard may be a little over 1/N.
        assert output["local_params"] == pytest.approx(total / world, rel=0.05)
        assert output["local_optim"] == pytest.approx(total / world, rel=0.05)  # one momentum buffer
    assert sum(o["local_params"] for o in outputs) == pytest.approx(total, rel=0.05)


def test_the_comparison_detects_a_different_step(reference: dict, tmp_path: Path) -> None:
    """Negative control: 2% more learning rate must show far beyond the fp32 tolerance."""
    spec = gpt_spec({"strategy": "ddp"})
    spec.workload.train.optimizer.lr *= 1.02
    difference = max_weight_difference(run(spec, 2, tmp_path), reference)
    print(f"lr x 1.02: max |weight - reference| = {difference:.2e}")
    assert difference > 100 * FP32_WEIGHTS


@pytest.mark.parametrize("name", list(AC_CASES))
def test_activation_checkpointing_changes_memory_not_math(name: str, reference: dict, tmp_path: Path) -> None:
    parallel, world, mode = AC_CASES[name]
    outputs = run(gpt_spec(parallel, activation_checkpointing=mode), world, tmp_path)
    assert outputs[0]["losses"] == pytest.approx(reference["losses"], abs=FP32_LOSS)
    assert max_weight_difference(outputs, reference) < FP32_WEIGHTS


def test_compiled_blocks_match_and_cache_under_the_run(reference: dict, tmp_path: Path) -> None:
    outputs = run(gpt_spec({}, compile_model=True), 1, tmp_path)
    difference = max_weight_difference(outputs, reference)
    print(f"compile: max |weight - reference| = {difference:.2e}")
    assert outputs[0]["losses"] == pytest.approx(reference["losses"], abs=1e-4)
    assert difference < 1e-4  # inductor fuses and reorders float operations
    assert any((tmp_path / "compile_cache").iterdir())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fp16_with_grad_scaler_matches_single_process_fp16(strategy: str, tmp_path: Path) -> None:
    single = run(gpt_spec({}, precision="fp16"), 1, tmp_path / "single")[0]
    outputs = run(gpt_spec({"strategy": strategy}, precision="fp16"), 2, tmp_path / strategy)
    assert outputs[0]["losses"] == pytest.approx(single["losses"], abs=1e-4)
    assert outputs[0]["skipped"] == single["skipped"]
    assert max_weight_difference(outputs, single) < 1e-4  # measured 2.1e-5
