"""Precision that fits the hardware (shoal/hardware.py): native, emulated or unsupported per
device, `auto` resolved the same on every rank, and the warnings of `shoal validate`, `shoal
plan` and `shoal doctor`. The CPU is simulated through torch's own probes, so every answer
here holds on any machine, with or without native bf16."""

from __future__ import annotations

import faulthandler
import os
from io import StringIO
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console

from shoal import cli
from shoal.hardware import EMULATED, NATIVE, UNSUPPORTED, Cpu, Cuda, resolve_auto, support, this_cpu
from tests.conftest import WORKLOADS
from tests.unit.parallel_harness import free_port

PROBES = ("_is_avx512_bf16_supported", "_is_amx_tile_supported", "_is_amx_fp16_supported")
CPUS = {  # torch's capability string, then what each of PROBES answers
    "avx2": ("AVX2", (False, False, False)),
    "avx512-bf16": ("AVX512", (True, False, False)),
    "amx": ("AVX512", (False, True, False)),
    "amx-fp16": ("AVX512", (True, True, True)),
}


def simulate_cpu(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """This process's torch sees a CPU of `kind`, and no GPU."""
    capability, answers = CPUS[kind]
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    for name, answer in zip(PROBES, answers, strict=True):
        monkeypatch.setattr(torch.cpu, name, lambda answer=answer: answer, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize(
    ("kind", "bf16", "fp16", "auto"),
    [
        ("avx2", EMULATED, EMULATED, "fp32"),
        ("avx512-bf16", NATIVE, EMULATED, "bf16"),
        ("amx", NATIVE, EMULATED, "bf16"),
        ("amx-fp16", NATIVE, NATIVE, "bf16"),
    ],
)
def test_cpu_precisions(monkeypatch, kind: str, bf16: str, fp16: str, auto: str) -> None:
    simulate_cpu(monkeypatch, kind)
    cpu = this_cpu()
    assert cpu.capability == CPUS[kind][0]
    assert support("bf16", cpu).status == bf16 and support("fp16", cpu).status == fp16
    assert support("fp32", cpu).status == NATIVE and support("fp8", cpu).status == UNSUPPORTED
    assert resolve_auto(cpu) == auto
    assert support("auto", cpu).status == NATIVE and support("auto", cpu).warning() is None


def test_an_avx2_cpu_is_named_with_the_cost(monkeypatch) -> None:
    simulate_cpu(monkeypatch, "avx2")
    warning = support("bf16", this_cpu()).warning()
    assert warning is not None
    for part in (
        "train.precision bf16 is emulated",
        "CPU AVX2 without AVX512-BF16 or AMX",
        "~23x",
        "auto or fp32",
    ):
        assert part in warning, warning


def test_a_torch_without_the_probes_falls_back_to_its_capability(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    for name in PROBES:
        monkeypatch.delattr(torch.cpu, name, raising=False)
    cpu = this_cpu()
    assert cpu == Cpu("AVX512", (), probed=False)
    assert resolve_auto(cpu) == "fp32"  # not known to be native: the safe choice
    assert "does not say" in cpu.describe()


def test_a_probe_that_raises_counts_as_unknown(monkeypatch) -> None:
    simulate_cpu(monkeypatch, "avx512-bf16")

    def broken() -> bool:
        raise RuntimeError("cpuinfo failed")

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", broken)
    assert this_cpu().features == ()


@pytest.mark.parametrize(
    ("capability", "bf16", "fp8", "auto"),
    [
        ((7, 5), EMULATED, UNSUPPORTED, "fp32"),
        ((8, 0), NATIVE, UNSUPPORTED, "bf16"),
        ((8, 9), NATIVE, NATIVE, "bf16"),
        ((9, 0), NATIVE, NATIVE, "bf16"),
    ],
)
def test_gpu_precisions(capability: tuple[int, int], bf16: str, fp8: str, auto: str) -> None:
    gpu = Cuda("NVIDIA X", capability)
    assert support("bf16", gpu).status == bf16 and support("fp8", gpu).status == fp8
    assert support("fp16", gpu).status == NATIVE and resolve_auto(gpu) == auto
    if bf16 == EMULATED:
        assert "use fp16, or auto" in (support("bf16", gpu).warning() or "")


def test_a_cuda_device_is_asked_for_its_capability(monkeypatch) -> None:
    from shoal.hardware import device_hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "Tesla T4")
    assert device_hardware(torch.device("cuda", 0)) == Cuda("Tesla T4", (7, 5))


@pytest.mark.parametrize(("kind", "expected"), [("avx2", "fp32"), ("avx512-bf16", "bf16")])
def test_the_worker_resolves_auto(monkeypatch, kind: str, expected: str) -> None:
    from shoal.worker.precision import Precision

    simulate_cpu(monkeypatch, kind)
    precision = Precision("auto", torch.device("cpu"), uses_fsdp=False)
    assert (precision.asked, precision.name) == ("auto", expected)
    assert precision.autocast_dtype == (torch.bfloat16 if expected == "bf16" else None)
    assert Precision("bf16", torch.device("cpu"), uses_fsdp=False).name == "bf16"  # as asked


def _agree(rank: int, port: int, kinds: list[list[str]], out: str) -> None:
    from shoal.worker.precision import agreed_precision

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    found = []
    for pair in kinds:
        capability, answers = CPUS[pair[rank]]
        for name, answer in zip(PROBES, answers, strict=True):
            setattr(torch.cpu, name, lambda answer=answer: answer)
        found.append(agreed_precision("auto", torch.device("cpu")))
    Path(out, f"rank{rank}").write_text(",".join(found))
    dist.barrier()  # no rank tears gloo down while another still reads the last collective
    dist.destroy_process_group()


def test_ranks_agree_on_auto(tmp_path: Path) -> None:
    """One rank without native bf16 makes every rank fp32 (FSDP's all-gathers need one dtype)."""
    kinds = [["avx512-bf16", "avx2"], ["avx512-bf16", "amx"]]
    mp.start_processes(_agree, args=(free_port(), kinds, str(tmp_path)), nprocs=2, start_method="spawn")
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["fp32,bf16", "fp32,bf16"]


def shoal_cli(monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[int, str]:
    """`shoal ARGV` in this process: its exit code and what it printed (wide, no wrapping)."""
    console = Console(width=400, file=StringIO())
    monkeypatch.setattr(cli, "console", console)
    code = cli.main(list(argv))
    return code, console.file.getvalue()


def test_validate_warns_of_emulated_bf16_on_an_avx2_cpu(monkeypatch) -> None:
    simulate_cpu(monkeypatch, "avx2")
    quickstart = str(WORKLOADS / "quickstart.yaml")
    code, printed = shoal_cli(monkeypatch, "validate", quickstart, "--set", "train.precision=bf16")
    assert code == 0 and printed.startswith("ok ")
    (warning,) = [line for line in printed.splitlines() if line.startswith("warning")]
    assert "bf16 is emulated on this machine's CPU AVX2" in warning and "auto or fp32" in warning
    code, printed = shoal_cli(monkeypatch, "validate", quickstart, "--set", "train.precision=auto")
    assert code == 0 and "auto (fp32 here)" in printed and "warning" not in printed


def test_validate_is_quiet_where_bf16_is_native(monkeypatch) -> None:
    simulate_cpu(monkeypatch, "amx")
    code, printed = shoal_cli(monkeypatch, "validate", str(WORKLOADS / "gpt_fsdp.yaml"))
    assert code == 0 and "auto (bf16 here)" in printed and "warning" not in printed


def _tiny(tmp_path: Path, precision: str) -> str:
    source = tmp_path / "w.yaml"
    source.write_text(
        f"name: w\nmodel: {{family: mlp}}\ndata: {{builtin: digits}}\n"
        f"train: {{max_steps: 1, precision: {precision}}}\nscaling: {{gpus_per_worker: 1}}\n"
    )
    return str(source)


@pytest.mark.parametrize(
    ("gpu", "precision", "title", "warning"),
    [
        ("t4-16gb", "bf16", "bf16,", "bf16 is emulated on NVIDIA T4 16GB PCIe (CUDA capability 7.5)"),
        ("t4-16gb", "auto", "fp32 (auto)", None),
        ("a100-80gb", "fp8", "fp8,", "fp8 cannot run on NVIDIA A100 80GB SXM (CUDA capability 8.0)"),
        ("h100-80gb", "auto", "bf16 (auto)", None),
    ],
)
def test_plan_warns_for_the_chosen_gpu(tmp_path, monkeypatch, gpu, precision, title, warning) -> None:
    code, printed = shoal_cli(monkeypatch, "plan", _tiny(tmp_path, precision), "--gpu", gpu, "--gpus", "2")
    assert code == 0 and f"parameters, {title}" in printed
    warnings = [line for line in printed.splitlines() if line.startswith("warning train.precision")]
    assert [warning in line for line in warnings] == ([True] if warning else [])


def test_doctor_rows_on_an_avx2_cpu(tmp_path, monkeypatch) -> None:
    import json

    from shoal.cli_inspect import doctor_table
    from shoal.plan import doctor

    simulate_cpu(monkeypatch, "avx2")
    monkeypatch.setattr(doctor, "cpu_slowdown", lambda names, budget_s: {"bf16": 22.9, "fp16": 23.4})
    monkeypatch.chdir(tmp_path)  # the workload's default tracking store would be looked for here
    workload = str(WORKLOADS / "quickstart.yaml")
    code, printed = shoal_cli(
        monkeypatch, "doctor", workload, "--set", "train.precision=bf16", "--format", "json"
    )
    assert code == 0  # a warning is not a failure
    rows = {row["check"]: row for row in json.loads(printed)}
    assert (
        rows["cpu"]["status"] == "ok"
        and rows["cpu"]["found"] == "torch capability AVX2; no AVX512-BF16 or AMX"
    )
    bf16 = rows["bf16 on cpu"]
    assert bf16["status"] == "warning" and "emulated by its flags; 23x fp32's time" in bf16["found"]
    assert "auto or fp32" in bf16["hint"]
    precision = rows["precision"]
    assert precision["status"] == "warning" and precision["found"].startswith(
        "bf16: emulated on this machine's CPU AVX2"
    )
    assert precision["hint"] == "use auto or fp32 for full speed"
    code, printed = shoal_cli(
        monkeypatch, "doctor", workload, "--set", "train.precision=auto", "--format", "json"
    )
    found = {row["check"]: row for row in json.loads(printed)}["precision"]
    assert found["status"] == "ok" and found["found"].startswith(
        "auto (fp32 here): native on this machine's CPU AVX2"
    )
    text = StringIO()
    Console(width=80, file=text).print(doctor_table([{**bf16, "found": "x"}]))
    assert "!" in text.getvalue()


def test_doctor_rows_where_bf16_is_native(monkeypatch) -> None:
    from shoal.plan import doctor

    simulate_cpu(monkeypatch, "avx512-bf16")
    monkeypatch.setattr(doctor, "cpu_slowdown", lambda names, budget_s: {"bf16": 0.9, "fp16": 12.0})
    rows = {c.name: c for c in doctor.cpu_precisions()}
    assert rows["cpu"].detail == "torch capability AVX512; AVX512-BF16"
    assert rows["bf16 on cpu"].mark == doctor.OK and rows["fp16 on cpu"].mark == doctor.WARN
    assert "auto or bf16" in rows["fp16 on cpu"].hint


def test_the_slowdown_is_measured_on_this_cpu() -> None:
    from shoal.hardware import cpu_slowdown

    threads = torch.get_num_threads()
    ratios = cpu_slowdown(("bf16", "fp16"), budget_s=0.05)
    assert set(ratios) == {"bf16", "fp16"} and all(r > 0 for r in ratios.values())
    assert torch.get_num_threads() == threads


def test_the_attempt_line_says_what_auto_became() -> None:
    from shoal.launch.progress import _attempt_line

    fields = {"world_size": 2, "device": "cpu", "parameters": 10, "accumulation": 1}
    parallel = {
        "precision": "fp32",
        "precision_asked": "auto",
        "hardware": "CPU AVX2 without AVX512-BF16 or AMX",
    }
    assert "precision auto: fp32 on CPU AVX2" in _attempt_line({**fields, "parallel": parallel})
    assert "precision" not in _attempt_line({**fields, "parallel": {**parallel, "precision_asked": "fp32"}})


def test_the_attempt_event_records_what_auto_became(tmp_path: Path, monkeypatch) -> None:
    """The real Trainer on `LocalContext`: the run's first event names the precision it trains in."""
    from tests.unit.test_trainer import rows, trainer, workload

    simulate_cpu(monkeypatch, "avx2")
    t, context = trainer(tmp_path, workload(train={"max_steps": 1, "precision": "auto"}), rows(16))
    try:
        t.run()
    finally:  # a run that fails leaves the hang watchdog armed (test_trainer.py's fixture)
        faulthandler.cancel_dump_traceback_later()
    (started,) = context.events("attempt_started")
    assert started["parallel"]["precision"] == "fp32" and started["parallel"]["precision_asked"] == "auto"
    assert started["parallel"]["hardware"] == "CPU AVX2 without AVX512-BF16 or AMX"
