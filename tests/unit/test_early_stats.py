"""The step's numbers leave for the other ranks between the last forward and the last backward
pass (CPU), so that the all-reduce's wait overlaps the backward pass."""

from __future__ import annotations

import torch

from shoal.worker.engine import Engine, StepLoss
from tests.unit.parallel_harness import SEQ, gpt_spec


def test_after_forward_gets_the_whole_steps_loss_before_the_last_backward_pass() -> None:
    engine = Engine(gpt_spec({"strategy": "ddp"}).workload, "lm", 1, torch.device("cpu"), 1, accumulation=2)
    batches = [
        {"tokens": torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(s))}
        for s in (1, 2)
    ]
    first = next(engine.parts[0].parameters())
    seen: list[tuple[StepLoss, torch.Tensor]] = []

    def after_forward(loss: StepLoss) -> None:
        seen.append((loss, first.grad.clone()))

    returned = engine.forward_backward(batches, after_forward=after_forward)
    ((loss, grad_then),) = seen
    assert loss == returned  # the same numbers, read once
    engine.discard_gradients()
    engine.forward_backward(batches[:1])  # the first micro-batch's backward pass alone
    assert torch.allclose(grad_then * 2, first.grad)  # then: only the first half of the step's gradient
    solo = [engine.forward_backward([b]).loss for b in batches]
    assert abs(loss.loss - sum(solo) / 2) < 1e-5  # the mean over both micro-batches
