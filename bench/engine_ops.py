"""The work inside one training step, without Ray: bench/gpt_bench.yaml's Engine at world
size 1 on one thread, profiled with torch.profiler (operators, call counts, self CPU time).

    .venv/bin/python bench/engine_ops.py [--steps 8] [--rows 25]
    PYTHONPATH=OTHER_CHECKOUT/platform .venv/bin/python bench/engine_ops.py

With another checkout first on PYTHONPATH it profiles that commit's Engine, so two commits'
tables can be compared operator by operator: a slowdown that shows in `make bench` but not
here lies outside the step's compute (DDP, the data stream, other processes). It takes the
Engine's first argument as that commit names it (a Workload, or the older resolved dict).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch
import yaml
from torch.profiler import profile

from shoal.spec.schema import Workload
from shoal.worker.engine import Engine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import GPT_ARGS, MICRO_BATCH, WARMUP_STEPS  # noqa: E402

WORKLOAD = REPO / "bench" / "gpt_bench.yaml"


def build_engine() -> Engine:
    workload = Workload.model_validate(yaml.safe_load(WORKLOAD.read_text()))
    first = list(inspect.signature(Engine.__init__).parameters)[1]
    spec = workload if first == "workload" else workload.resolved()  # older commits took a dict
    return Engine(spec, "lm", 1, torch.device("cpu"), 1000, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = build_engine()
    generator = torch.Generator().manual_seed(0)
    shape = (MICRO_BATCH, GPT_ARGS["seq_len"] + 1)  # the peers' micro-batch: windows of seq_len + 1
    vocab = GPT_ARGS["vocab_size"]
    batches = [{"tokens": torch.randint(0, vocab, shape, generator=generator)} for _ in range(8)]
    for index in range(WARMUP_STEPS):
        engine.forward_backward([batches[index % 8]])
        engine.optimizer_step()
    with profile() as profiler:
        for index in range(args.steps):
            engine.forward_backward([batches[index % 8]])
            engine.optimizer_step()
    print(f"{engine.parameters:,} parameters, {args.steps} steps, {torch.backends.cpu.get_cpu_capability()}")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
