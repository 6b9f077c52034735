"""`make gpu-check` (bench/gpu_check.sh, bench/gpu_check.py) without a GPU: the size it picks,
its MFU arithmetic, the BENCHMARKS.md rows it writes, its no-GPU exit, and that neither it nor
the GPU-gated tests import Ray or MLflow (the GPU machine has neither)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpu_check, gpu_report, gpu_sizing
from bench.gpu_sizing import LADDER, choose_size, loss_fell, mfu, steady, tokens_per_s

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "data" / "gpu_check_results.json"
GIB = 2**30


@pytest.fixture(scope="module")
def ladder() -> dict[str, gpu_sizing.Planned]:
    """What the planner says of each ladder size (one meta-device trace each)."""
    micro = gpu_sizing.MICRO_BATCH
    return {
        s.name: gpu_sizing.planned(gpu_sizing.workload(s, "bf16", micro, 100, True), micro) for s in LADDER
    }


@pytest.fixture(scope="module")
def estimates(ladder: dict[str, gpu_sizing.Planned]) -> dict[str, float]:
    return {name: planned.estimate_bytes for name, planned in ladder.items()}


@pytest.fixture
def results() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


# -- the size ------------------------------------------------------------------------
@pytest.mark.parametrize(("gib", "size"), [(24, "125M"), (48, "760M"), (80, "1.3B"), (141, "1.3B")])
def test_the_largest_ladder_size_whose_planner_estimate_fits(
    estimates: dict[str, float], gib: int, size: str
) -> None:
    assert choose_size(gpu_sizing.usable_bytes(gib * GIB), estimates) == size


def test_the_ladder_grows_and_its_estimates_with_it(estimates: dict[str, float]) -> None:
    peaks = [estimates[size.name] for size in LADDER]
    assert peaks == sorted(peaks) and LADDER[-1].name == "1.3B"
    assert choose_size(peaks[0] - 1, estimates) is None  # not even the smallest fits
    assert choose_size(peaks[2], estimates) == LADDER[2].name  # an estimate equal to the room fits
    # the planner's own headroom: CUDA's context off the top, then a share for fragmentation
    assert gpu_sizing.usable_bytes(80 * GIB) < 0.95 * 80 * GIB


def test_the_ladder_sizes_have_the_parameters_their_names_say(ladder: dict[str, gpu_sizing.Planned]) -> None:
    for name, planned in ladder.items():
        named = float(name.rstrip("MB")) * (1000 if name.endswith("B") else 1)
        assert 0.9 * named <= planned.parameters / 1e6 <= 1.1 * named, (name, planned.parameters)
    work = gpu_sizing.workload(LADDER[-1], "bf16", 8, 100, compile_model=True)
    assert work.parallel.strategy == "fsdp" and work.train.compile and work.train.precision == "bf16"


# -- the arithmetic ------------------------------------------------------------------
def test_mfu_is_model_flops_per_second_over_the_peak() -> None:
    # 6 x 1.3e9 parameters x 16,384 tokens in 0.5 s on an H100's 989.4 dense bf16 TFLOP/s
    flops = 6 * 1.3e9 * 16384
    assert mfu(flops, 0.5, 989.4e12) == pytest.approx(flops / 0.5 / 989.4e12)
    assert mfu(flops, 0.5, 989.4e12) == pytest.approx(0.2583, abs=1e-4)
    assert mfu(2e14, 1.0, 1e15) == pytest.approx(0.2)


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])  # as torch names the lent GPUs
def test_mfu_divides_by_the_catalogs_dense_bf16_peak(name: str) -> None:
    peak, described = gpu_check.peak_flops(name)
    assert peak == pytest.approx(989.4e12) and described is not None and "989.4 TFLOP/s" in described
    assert gpu_check.peak_flops("cpu") == (None, None)


def test_throughput_counts_only_the_steps_after_warm_up() -> None:
    seconds = [60.0, 2.0, 0.5, 0.25]
    assert steady(seconds, 2) == [0.5, 0.25]
    assert tokens_per_s(steady(seconds, 2), 1000) == [2000.0, 4000.0]


def test_loss_fell_compares_the_first_and_last_five_steps() -> None:
    assert loss_fell([10, 10, 10, 10, 10, 9, 5, 5, 5, 5, 5]) == (10, 5, True)
    assert loss_fell([5.0] * 10)[2] is False
    assert loss_fell([1, 2, 3, 4, 5, 6, float("nan"), 8, 9, 10])[2] is False


# -- the rows ------------------------------------------------------------------------
def test_the_section_names_the_command_the_machine_and_the_medians(results: dict[str, Any]) -> None:
    text = "\n".join(gpu_report.section(results))
    assert text.startswith("## One GPU\n")
    for fact in (
        "`bash bench/gpu_check.sh`",
        "NVIDIA H100 80GB HBM3",
        "driver 580.159.04",
        "torch 2.11.0+cu130",
    ):
        assert fact in text
    assert "CUDA 13.0" in text and "CUDA capability 9.0" in text and "360 s in all (budget 480 s)" in text
    assert "Installed for the check: pydantic from bench/wheels into /tmp/shoal-gpu-check-site." in text
    assert "`python -m pytest -q -rs tests/unit/test_gpu_monitoring.py`: 3 passed in 21.40s" in text
    assert "the 1.3B GPT (1,315M parameters" in text and "fits 70.4 GiB" in text
    # bf16: steps 6-10 timed: 0.5, 0.4, 0.5, 0.6, 0.5 s of 16,384 tokens and 160 TFLOP
    bf16 = next(line for line in text.splitlines() if line.startswith("| bf16 |"))
    cells = [cell.strip() for cell in bf16.strip("|").split("|")]
    assert cells[1:4] == ["5", "32,768 (27,307-40,960)", "32.3 (27-40.4) %"]  # MFU = 1.6e14/0.5/989.4e12
    assert cells[4:] == ["0.5 (0.4-0.6)", "61.5", "43.1", "47.4", "1.10", "10.52 -> 8.94"]
    assert "| fp8 (micro-batch 4) | 5 | 40,960 (40,960-40,960) |" in text
    assert "fp8 / bf16 tokens/s (medians): 1.25; fp8 loss fell" in text
    assert "within 25% of it: yes" in text
    assert "fp8: 1.3B at micro-batch 8: OutOfMemoryError" in text
    assert "did not train" not in text and gpu_report.problems(results) == []
    results["choice"]["size"] = "2.7B"  # a bf16 run that fell back down the ladder says so
    assert "the planner's choice, 2.7B, did not train" in gpu_report.model_line(results)


def test_a_skipped_or_failed_run_is_a_row_that_says_why(results: dict[str, Any]) -> None:
    results["runs"]["fp8"] = {"status": "skipped", "reason": "torchao not available"}
    text = "\n".join(gpu_report.section(results))
    assert "| fp8 | skipped: torchao not available |" + " |" * 8 in text
    assert "fp8 / bf16" not in text and gpu_report.problems(results) == []
    results["runs"]["bf16"] = {"status": "running", "attempts": []}
    gpu_check.mark_unfinished(results, {"bf16": "124", "fp8": "0"})
    assert results["runs"]["bf16"] == {
        "status": "failed",
        "attempts": [],
        "reason": "killed at its time limit",
    }
    assert "| bf16 | failed: killed at its time limit |" in "\n".join(gpu_report.section(results))
    assert gpu_report.problems(results) == ["bf16: failed: killed at its time limit"]


def test_problems_name_failed_tests_a_flat_loss_and_a_missing_run(results: dict[str, Any]) -> None:
    broken = copy.deepcopy(results)
    broken["tests"].update(returncode=1, summary="1 failed, 2 passed in 30s")
    broken["runs"]["fp8"]["losses"] = [9.0] * 10
    assert gpu_report.problems(broken) == [
        "GPU-gated tests: 1 failed, 2 passed in 30s",
        "fp8: the loss did not fall (mean of the first 5 steps vs the last 5)",
    ]
    broken["tests"].update(returncode=0, summary="3 skipped in 2s")  # a GPU machine whose tests skip
    assert gpu_report.problems(broken)[0] == "GPU-gated tests: 3 skipped in 2s"
    del results["runs"]["fp8"]
    gpu_check.mark_unfinished(results, {"fp8": "not-run"})
    assert results["runs"]["fp8"]["status"] == "skipped" and gpu_report.problems(results) == []


def test_the_section_replaces_its_old_self_and_nothing_else() -> None:
    recovery = gpu_report.RECOVERY_SECTION
    before = f"# Benchmarks\n\nintro\n\n## Data\n\nrows\n\n{recovery}\n\nrecovery rows\n"
    new = ["## One GPU", "", "new rows"]
    inserted = gpu_report.replace_section(before, new)
    assert inserted == before.replace(recovery, f"## One GPU\n\nnew rows\n\n{recovery}")
    again = gpu_report.replace_section(inserted, ["## One GPU", "", "newer rows"])
    assert again == inserted.replace("new rows", "newer rows")
    at_end = gpu_report.replace_section("# Benchmarks\n\n## Data\n\nrows\n", new)
    assert at_end == "# Benchmarks\n\n## Data\n\nrows\n\n## One GPU\n\nnew rows\n"
    assert gpu_report.replace_section(at_end, new) == at_end
    assert gpu_report.replace_section("", new) == "## One GPU\n\nnew rows\n"


def test_render_rewrites_the_section_from_the_results_file(tmp_path: Path, results: dict[str, Any]) -> None:
    saved, markdown = tmp_path / "results_gpu.json", tmp_path / "BENCHMARKS.md"
    saved.write_text(json.dumps(results))
    markdown.write_text("# Benchmarks\n\n## Data\n\nkept as it is\n")
    assert gpu_check.main(["render", "--results", str(saved), "--out", str(markdown)]) == 0
    text = markdown.read_text()
    assert text.startswith("# Benchmarks\n\n## Data\n\nkept as it is\n\n## One GPU\n")
    assert "| bf16 | 5 | 32,768" in text


# -- the script ----------------------------------------------------------------------
def test_every_gpu_gated_test_file_is_run_by_the_check() -> None:
    gated = {
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if "no CUDA GPU here" in path.read_text() and path != Path(__file__)
    }
    assert gated == set(gpu_check.GPU_TESTS)


def test_pytest_summary_is_the_closing_line() -> None:
    output = "....\n=========== 2 passed, 1 skipped in 3.21s ===========\n"
    assert gpu_check.pytest_summary(output) == "2 passed, 1 skipped in 3.21s"
    assert gpu_check.pytest_summary("boom") == "no summary line (see the log)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the check would run")
@pytest.mark.parametrize(
    ("python", "why"),
    [(sys.executable, "torch.cuda.is_available() is False"), ("/nonexistent/python", "cannot import torch")],
)
def test_without_a_gpu_the_script_says_so_in_one_line_and_exits_0(python: str, why: str) -> None:
    env = {**os.environ, "PYTHON": python}
    done = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"gpu-check: no CUDA GPU on this machine \(.*\); nothing to do\n", done.stdout)
    assert why in done.stdout and done.stderr == ""


HIDDEN = """
import atexit, importlib, runpy, sys
tried = []
class Hide:  # what the GPU machine lacks: Ray and MLflow
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("ray", "mlflow"):
            tried.append(name)
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Hide())
atexit.register(lambda: print("TRIED", sorted(set(tried))))
for module in sys.argv[1].split(","):
    importlib.import_module(module)
sys.argv = ["bench/gpu_check.py", *sys.argv[2:]]
sys.exit(runpy.run_path("bench/gpu_check.py", run_name="__main__")["main"]())
"""


def hidden_ray(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    modules = ",".join(p.removesuffix(".py").replace("/", ".") for p in gpu_check.GPU_TESTS)
    command = [sys.executable, "-c", HIDDEN, modules, *args, "--results", str(tmp_path / "r.json")]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_the_check_trains_on_a_cpu_importing_no_ray_or_mlflow(tmp_path: Path) -> None:
    """The whole train phase (Engine, planner estimate, timing) on a tiny GPT on the CPU, with
    Ray and MLflow hidden; the GPU-gated test modules import under the same conditions."""
    assert gpu_check.main(["start", "--device", "cpu", "--results", str(tmp_path / "r.json")]) == 0
    done = hidden_ray(tmp_path, "train", "--device", "cpu", "--size", "tiny", "--steps", "7", "--no-compile")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TRIED []" in done.stdout
    run = json.loads((tmp_path / "r.json").read_text())["runs"]["bf16"]
    assert run["status"] == "ok", run
    assert len(run["step_seconds"]) == len(run["losses"]) == 7 and run["warmup"] == 5
    assert run["tokens_per_step"] == 2 * 64 and run["flops_per_step"] > 0 and run["estimate_bytes"] > 0
    assert run["peak_bytes"] is None and run["peak_flops"] is None  # no CUDA, no catalog GPU
