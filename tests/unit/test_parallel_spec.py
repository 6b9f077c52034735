"""Parallelism and precision refusals, through `shoal validate` (the real CLI), exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shoal.spec import SpecError, load
from tests.conftest import WORKLOADS

GPT = str(WORKLOADS / "gpt_fsdp.yaml")


def validate(*overrides: str, workload: str = GPT) -> subprocess.CompletedProcess:
    args = [a for o in overrides for a in ("--set", o)]
    return subprocess.run(
        [sys.executable, "-m", "shoal.cli", "validate", workload, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


REFUSALS = {
    "cnn cannot do tensor parallel": (
        ["parallel.strategy=tp"],
        str(WORKLOADS / "quickstart.yaml"),
        "parallel: model 'cnn' supports ddp, fsdp and hsdp only (tp=2, pp=1)",
    ),
    "heads not divisible by tp": (
        ["parallel.strategy=tp", "scaling.workers=3", "train.global_batch_size=48"],
        GPT,
        "parallel.tp: model.args.n_heads (4) is not divisible by tp (3)",
    ),
    "fewer layers than stages": (
        ["parallel.strategy=pp", "model.args.tie_embeddings=false", "model.args.n_layers=1"],
        GPT,
        "parallel.pp: 2 pipeline stages need at least 2 layers (model.args.n_layers is 1)",
    ),
    "pp needs untied embeddings": (
        ["parallel.strategy=pp"],
        GPT,
        "model.args: pipeline parallelism needs tie_embeddings: false",
    ),
    "degrees do not make the world": (
        ["parallel={tp: 2, pp: 2, dp_shard: 1}"],
        GPT,
        "parallel: pp=2 x tp=2 makes 4 ranks but there are 2 workers (scaling.workers: 2)",
    ),
    "degrees cannot fill the world": (
        ["parallel={tp: 2}", "scaling.workers=3", "train.global_batch_size=48"],
        GPT,
        "parallel: tp=2 cannot split 3 workers (3 is not a multiple of 2; dp_shard would take the rest)",
    ),
    "two fill degrees": (["parallel={tp: -1, dp_shard: -1}"], GPT, "parallel: only one degree may be -1"),
    "microbatches do not divide the batch": (
        ["parallel.strategy=pp", "model.args.tie_embeddings=false", "parallel.microbatches=3"],
        GPT,
        "parallel.microbatches: 3 does not divide the pipeline batch of 16 rows",
    ),
    "1f1b needs enough microbatches": (
        [
            "parallel.strategy=pp",
            "model.args.tie_embeddings=false",
            "parallel.pp_schedule=interleaved_1f1b",
            "parallel.microbatches=2",
        ],
        GPT,
        "parallel.microbatches: interleaved_1f1b needs at least as many microbatches as stages (4)",
    ),
    "batch does not divide": (
        ["train.global_batch_size=20"],
        GPT,
        "train.global_batch_size: 20 is not a multiple of data.batch_size (8) x 2 workers",
    ),
    "fp8 on cpu": (
        ["train.precision=fp8"],
        GPT,
        "train.precision: fp8 needs CUDA GPUs of capability >= 8.9 (Ada, Hopper or newer); "
        "scaling.gpus_per_worker is 0",
    ),
    "fp16 with pp": (
        ["parallel.strategy=pp", "model.args.tie_embeddings=false", "train.precision=fp16"],
        GPT,
        "train.precision: fp16 loss scaling is not supported with pipeline parallelism",
    ),
    "unknown strategy": (["parallel.strategy=zero3"], GPT, "parallel.strategy: must be one of"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_before_launch(case: str) -> None:
    overrides, workload, message = REFUSALS[case]
    result = validate(*overrides, workload=workload)
    assert result.returncode == 2, result.stdout
    assert "Traceback" not in result.stderr
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize("name", ["gpt_fsdp.yaml", "gpt_hybrid.yaml"])
def test_parallel_workloads_validate(name: str) -> None:
    load(WORKLOADS / name)


def test_fp8_is_refused_by_the_worker_without_a_capable_gpu() -> None:
    import torch

    from shoal.worker.precision import Precision, PrecisionError

    with pytest.raises(PrecisionError, match=r"capability >= 8.9.*this worker has no CUDA GPU"):
        Precision("fp8", torch.device("cpu"), uses_fsdp=False)


def test_explicit_degrees_accept_minus_one(tmp_path: Path) -> None:
    loaded = load(GPT, ["parallel={dp_shard: -1, tp: 2}", "scaling.workers=4", "train.global_batch_size=32"])
    assert loaded.workload.parallel.tp == 2


USER_MODEL = """
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


class Wide(torch.nn.Module):
    task = "classify"

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, hidden), torch.nn.Linear(hidden, 10)

    def forward(self, x):
        return self.down(torch.relu(self.up(x.flatten(1))))

    @classmethod
    def parallel_problems(cls, args, tp, stages):
        hidden = args.get("hidden", 64)
        problems = [("parallel.tp", f"hidden ({hidden}) does not split {tp} ways")] if hidden % tp else []
        return problems + ([("parallel.pp", "Wide has no pipeline stages")] if stages > 1 else [])

    def tensor_parallel_plan(self):
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}

    def pipeline_stage(self, stage, num_stages):
        raise NotImplementedError("parallel_problems refuses pipelines")

    def fp8_filter(self, module, fqn):
        return fqn != "down"
"""


def test_a_user_model_opts_into_tensor_parallel_through_the_protocol(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "wide_model.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    workload = tmp_path / "wide.yaml"
    quickstart = (WORKLOADS / "quickstart.yaml").read_text()
    workload.write_text(
        quickstart.replace("family: cnn\n  args: {channels: 32}", 'target: "wide_model:Wide"')
    )
    assert load(workload, ["parallel.strategy=tp"]).workload.parallel.strategy == "tp"
    with pytest.raises(SpecError, match=r"hidden \(63\) does not split 2 ways"):
        load(workload, ["parallel.strategy=tp", "model.args.hidden=63"])
    with pytest.raises(SpecError, match="parallel.pp: Wide has no pipeline stages"):
        load(workload, ["parallel.strategy=pp"])
