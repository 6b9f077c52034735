"""Precision policies without distribution: fp16 skip counting, bf16 autocast, fp8 gate."""

from __future__ import annotations

import pytest
import torch

from shoal.worker import precision
from shoal.worker.precision import Precision, PrecisionError, fp8_supported


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_fp16_overflow_skips_the_step_and_counts_it() -> None:
    model, optimizer = _model_and_optimizer()
    precision = Precision("fp16", torch.device("cpu"), uses_fsdp=False)
    before = [p.detach().clone() for p in model.parameters()]
    with precision.autocast():
        loss = model(torch.ones(3, 4)).sum() * float("inf")
    precision.backward(loss)
    precision.unscale([optimizer])
    assert precision.step([optimizer]) is False
    assert precision.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    optimizer.zero_grad()
    with precision.autocast():  # small enough that the scaled fp16 gradients stay finite
        loss = model(torch.full((1, 4), 0.01)).sum()
    precision.backward(loss)
    precision.unscale([optimizer])
    assert precision.step([optimizer]) is True and precision.skipped_steps == 1


def test_bf16_uses_autocast_without_fsdp_and_the_policy_with_it() -> None:
    plain = Precision("bf16", torch.device("cpu"), uses_fsdp=False)
    with plain.autocast():
        assert torch.nn.Linear(4, 4)(torch.ones(1, 4)).dtype == torch.bfloat16
    sharded = Precision("bf16", torch.device("cpu"), uses_fsdp=True)
    assert sharded.fsdp_param_dtype == torch.bfloat16 and sharded.autocast_dtype is None


@pytest.mark.skipif(fp8_supported(), reason="this machine has an fp8-capable GPU")
def test_fp8_is_refused_here_with_the_requirement() -> None:
    with pytest.raises(PrecisionError, match=r"needs a CUDA GPU of capability >= 8.9"):
        Precision("fp8", torch.device("cpu"), uses_fsdp=False)


def test_fp8_runs_everything_but_its_float8_matmuls_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "require_fp8", lambda: None)  # as on a GPU of capability >= 8.9
    replicated = Precision("fp8", torch.device("cpu"), uses_fsdp=False)
    assert replicated.autocast_dtype == torch.bfloat16 and replicated.fsdp_param_dtype is None
    sharded = Precision("fp8", torch.device("cpu"), uses_fsdp=True)
    assert sharded.fsdp_param_dtype == torch.bfloat16 and sharded.autocast_dtype is None
