"""What every contender trains, identically: the ~10M-parameter byte GPT on pytext.

The peers import only torch/ray/pyarrow and this file; the model is the same
torch module shoal uses, so the comparison measures the platforms, not models.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

GPT_ARGS = {"n_layers": 6, "d_model": 384, "n_heads": 6, "vocab_size": 256, "seq_len": 256}
MICRO_BATCH = 4  # sequences per worker per step (no accumulation)
WORKERS = 2
WARMUP_STEPS = 5  # excluded from steady state
LR = 1e-3


def data_dir(seq_len: int = GPT_ARGS["seq_len"]) -> Path:
    from shoal.data import prepare

    return prepare("pytext", seq_len=seq_len)


def steady_tokens_per_s(step_ends: list[float], tokens_per_step: int) -> float:
    """Median over steps after warm-up of tokens / step wall time."""
    durations = [b - a for a, b in zip(step_ends[WARMUP_STEPS:], step_ends[WARMUP_STEPS + 1 :], strict=False)]
    return tokens_per_step / statistics.median(durations)


def train_step(model, optimizer, tokens, autocast):  # noqa: ANN001, ANN201 (plain torch objects)
    """One plain step, as each peer writes it: forward, loss, backward, clip, AdamW.
    Returns the loss tensor (no device sync here)."""
    import torch
    import torch.nn.functional as F

    with autocast:
        logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.detach()


def steady_window(step_ends: list[float]) -> dict[str, float]:
    """The wall-clock span that steady_tokens_per_s measures (for the CPU profile)."""
    return {"steady_from": step_ends[WARMUP_STEPS], "steady_to": step_ends[-1]}


def write_result(path: str | None, **fields: object) -> None:
    if path:
        Path(path).write_text(json.dumps(fields))


def process_start() -> float:
    """Wall-clock time this contender was launched (set by the bench runner)."""
    return float(os.environ.get("BENCH_START", time.time()))


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ (inherited by the processes started meanwhile), then as before."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
