"""`make gpu-check` (bench/gpu_check.sh): shoal on one CUDA GPU, without Ray or MLflow.

Phases, each a command of this script that bench/gpu_check.sh runs under a time limit,
each adding to one results file (bench/results_gpu.json):

    start    the machine: GPU, memory, capability, driver, torch, CUDA, Python
    tests    the GPU-gated tests (GPU_TESTS) under pytest
    train    shoal's Engine training the largest ladder GPT that fits (bench/gpu_sizing.py)
             at bf16, or at fp8 at the bf16 run's size, on synthetic token windows made on the
             GPU: per-step seconds and losses, CUDA peak memory, the planner's estimate
    render   the One GPU section of BENCHMARKS.md (bench/gpu_report.py); exit 1 on a failure

On one GPU shoal's `fsdp` strategy resolves to dp_shard 1: the Engine applies no sharding and
needs no process group, so this runs as a plain process (no torchrun). `--device cpu --size
tiny` runs the same code on a CPU in seconds (tests/unit/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "platform")]  # shoal without installing it

from bench import gpu_report, gpu_sizing  # noqa: E402
from bench.gpu_sizing import LADDER, MICRO_BATCH, SIZES, Size  # noqa: E402

GPU_TESTS = ("tests/unit/test_gpu_monitoring.py",)  # every test file skipped with "no CUDA GPU here"
RESULTS = REPO / "bench" / "results_gpu.json"
STEPS = {"bf16": 100, "fp8": 50}
WARMUP = 5  # steps not timed: compile runs in the first, and the allocator settles
MIN_TIMED = 5  # past its deadline a run stops once this many steps are timed
FP8_FALLBACK_MICRO = 4  # fp8 runs what autocast does not cover in fp32: it may need a smaller batch


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def save(path: Path, results: dict[str, Any]) -> None:
    path.write_text(json.dumps(results, indent=1) + "\n")


# -- start ---------------------------------------------------------------------------
def driver_version() -> str:
    try:  # nvidia-ml-py: on the GPU machine, not a dependency of this script
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:
        return "unknown"


def machine(device: str) -> dict[str, Any]:
    import torch  # deferred: `render` needs no torch

    found = {"torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    found.update(python=platform.python_version(), cpus=os.cpu_count())
    if device == "cpu":
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        found.update(gpu="no GPU (CPU run)", memory_bytes=memory, capability="n/a", driver="n/a")
        return found
    props = torch.cuda.get_device_properties(0)
    found.update(gpu=props.name, memory_bytes=props.total_memory, driver=driver_version())
    found["capability"] = f"{props.major}.{props.minor}"
    return found


def start(args: argparse.Namespace) -> int:
    results = {"command": args.command, "began": time.time(), "budget_s": args.budget_s}
    results |= {"machine": machine(args.device), "wheels": args.wheels, "runs": {}}
    save(args.results, results)
    m = results["machine"]
    print(f"gpu-check: {m['gpu']}, driver {m['driver']}, torch {m['torch']}, CUDA {m['cuda']}", flush=True)
    return 0


# -- tests ---------------------------------------------------------------------------
def pytest_summary(output: str) -> str:
    """pytest's closing line without its decoration: '3 passed in 12.1s'."""
    lines = [
        line.strip("= ")
        for line in output.splitlines()
        if re.search(r"\d+ (passed|failed|skipped|error)", line)
    ]
    return lines[-1] if lines else "no summary line (see the log)"


def tests(args: argparse.Namespace) -> int:
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *GPU_TESTS]
    shown = "python -m pytest -q -rs " + " ".join(GPU_TESTS)
    began = time.time()
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout_s)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:  # its output may come back as bytes
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        output, code = f"{partial}\ntimed out after {args.timeout_s} s", 124
    print(output[-6000:], flush=True)
    summary = pytest_summary(output) if code != 124 else f"timed out after {args.timeout_s} s"
    results = load(args.results)
    results["tests"] = {
        "command": shown,
        "returncode": code,
        "summary": summary,
        "seconds": time.time() - began,
    }
    save(args.results, results)
    return code


# -- train ---------------------------------------------------------------------------
class SyntheticTokens:
    """Token windows a model learns fast (so that a falling loss means training works): tokens
    from a fixed random quarter of the vocabulary, each window one random segment repeated.
    Made on the device, so no data pipeline takes part in the timing."""

    def __init__(self, size: Size, micro: int, device: Any, seed: int = 0):
        import torch  # deferred: `render` needs no torch

        self.torch, self.size, self.micro, self.device = torch, size, micro, device
        chooser = torch.Generator().manual_seed(seed)
        self.ids = torch.randperm(size.vocab_size, generator=chooser)[: size.vocab_size // 4].to(device)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.period = max(1, size.seq_len // 16)

    def next(self) -> dict[str, Any]:
        shape = (self.micro, self.period)
        picks = self.torch.randint(0, len(self.ids), shape, device=self.device, generator=self.generator)
        repeats = -(-(self.size.seq_len + 1) // self.period)
        return {"tokens": self.ids[picks].repeat(1, repeats)[:, : self.size.seq_len + 1]}


def peak_flops(device_name: str) -> tuple[float | None, str | None]:
    """The catalog's dense bf16 peak of a GPU by its torch name (what MFU divides by), and its
    description; (None, None) for a CPU or a GPU not in the catalog."""
    from shoal.plan.catalog import gpu_for_device  # deferred: `render` needs no shoal

    gpu = gpu_for_device(device_name)
    if gpu is None:
        return None, None
    described = f"the catalog's dense bf16 peak of the {gpu.name} ({gpu.peak_tflops['bf16']:,.1f} TFLOP/s)"
    return gpu.peak_flops("bf16"), described


def timed_steps(
    engine: Any, data: SyntheticTokens, steps: int, deadline: float
) -> tuple[list[float], list[float]]:
    """Seconds and loss of each optimizer step; past `deadline`, stops once MIN_TIMED are timed."""
    import torch

    def synchronize() -> None:  # the optimizer's kernels may still run when train_step returns
        if data.device.type == "cuda":
            torch.cuda.synchronize(data.device)

    seconds: list[float] = []
    losses: list[float] = []
    for step in range(steps):
        batch = data.next()
        synchronize()
        began = time.perf_counter()
        loss, _ = engine.train_step([batch])
        synchronize()
        seconds.append(time.perf_counter() - began)
        losses.append(loss)
        if step == 0 or (step + 1) % 10 == 0:
            print(f"  step {step + 1}: loss {loss:.4f}, {seconds[-1]:.3f} s", flush=True)
        if time.time() > deadline and step + 1 >= WARMUP + MIN_TIMED:
            break
    return seconds, losses


def train_one(
    size: Size, precision: str, micro: int, args: argparse.Namespace, deadline: float
) -> dict[str, Any]:
    import torch

    from shoal.worker.engine import Engine

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    steps = args.steps or STEPS[precision]
    work = gpu_sizing.workload(size, precision, micro, steps, compile_model=not args.no_compile)
    plan = gpu_sizing.planned(work, micro)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    engine = Engine(work, "lm", 1, device, total_steps=steps, accumulation=1)
    seconds, losses = timed_steps(
        engine, SyntheticTokens(size, micro, device, work.train.seed), steps, deadline
    )
    cuda = device.type == "cuda"
    peak, name = peak_flops(torch.cuda.get_device_name(device) if cuda else "cpu")
    return {
        "size": size.name,
        "args": size.args(),
        "parameters": plan.parameters,
        "micro": micro,
        "tokens_per_step": micro * size.seq_len,
        "flops_per_step": plan.flops_per_step,
        "peak_flops": peak,
        "peak_name": name,
        "estimate_bytes": plan.estimate_bytes,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "compile": not args.no_compile,
        "warmup": min(WARMUP, len(seconds) - 1),
        "step_seconds": seconds,
        "losses": losses,
    }


def fp8_unavailable(device: str) -> str | None:
    """Why fp8 cannot run here, or None."""
    import importlib.util

    from shoal.worker.precision import fp8_supported

    if not fp8_supported():
        return "fp8 needs a CUDA GPU of capability >= 8.9" if device == "cuda" else "no CUDA GPU"
    if importlib.util.find_spec("torchao") is None:
        return "torchao not available (run `make gpu-wheels` and carry bench/wheels)"
    return None


def attempts(args: argparse.Namespace, results: dict[str, Any]) -> list[tuple[Size, int]]:
    """(size, micro-batch) to try in turn: bf16 from the chosen size down the ladder; fp8 at the
    bf16 run's size and micro-batch, then at a smaller micro-batch."""
    micro = args.micro or (MICRO_BATCH if args.device == "cuda" else 2)
    done = results.get("runs", {}).get("bf16", {}) if args.precision == "fp8" else {}
    if done.get("status") == "ok":
        size, micro = SIZES[args.size or done["size"]], args.micro or done["micro"]
        return [(size, micro)] + ([(size, FP8_FALLBACK_MICRO)] if micro > FP8_FALLBACK_MICRO else [])
    if args.size:
        return [(SIZES[args.size], micro)]
    chosen = choose(results, micro)
    if chosen is None:
        return []
    below = [s for s in LADDER if LADDER.index(s) <= LADDER.index(SIZES[chosen])]
    return [(size, micro) for size in reversed(below)]


def choose(results: dict[str, Any], micro: int) -> str | None:
    """The ladder size the planner fits into this GPU's memory, recorded with the estimates."""
    estimates = gpu_sizing.ladder_estimates("bf16", micro)
    usable = gpu_sizing.usable_bytes(results["machine"]["memory_bytes"])
    chosen = gpu_sizing.choose_size(usable, estimates)
    results["choice"] = {"usable_bytes": usable, "estimates": estimates, "size": chosen}
    print(f"gpu-check: planner fits {chosen} into {usable / 2**30:.1f} GiB", flush=True)
    return chosen


def release_memory() -> None:
    import torch

    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train(args: argparse.Namespace) -> int:
    deadline = time.time() + args.budget_s
    results = load(args.results)
    run: dict[str, Any] = {"status": "running", "attempts": []}
    results.setdefault("runs", {})[args.precision] = run
    save(args.results, results)
    why = fp8_unavailable(args.device) if args.precision == "fp8" else None
    if why:
        run.update(status="skipped", reason=why)
    for size, micro in [] if why else attempts(args, results):
        if not attempt(run, size, micro, args, deadline):
            break
        save(args.results, results)
        release_memory()  # after the except block: its traceback held the failed run's tensors
    if run["status"] == "running":
        run.update(status="failed", reason="; ".join(run["attempts"]) or "no ladder size fits this GPU")
    save(args.results, results)
    print(f"gpu-check: {args.precision} {run['status']} {run.get('reason', '')}", flush=True)
    return 0 if run["status"] in ("ok", "skipped") else 1


def attempt(run: dict[str, Any], size: Size, micro: int, args: argparse.Namespace, deadline: float) -> bool:
    """One (size, micro-batch); True when the next one should be tried (this one ran out of
    memory and there is time left)."""
    print(f"gpu-check: {args.precision}, {size.name} GPT, micro-batch {micro}", flush=True)
    try:
        run.update(train_one(size, args.precision, micro, args, deadline), status="ok")
        return False
    except Exception as exc:  # recorded, whatever it is: the rows say what went wrong
        what = f"{size.name} at micro-batch {micro}: {type(exc).__name__}: {str(exc)[:300]}"
        run["attempts"].append(what)
        print(f"gpu-check: {what}", flush=True)
        return "out of memory" in str(exc).lower() and time.time() < deadline


# -- render --------------------------------------------------------------------------
def mark_unfinished(results: dict[str, Any], codes: dict[str, str]) -> None:
    """A phase killed at its time limit (exit 124) or crashed left its run `running`; one the
    shell script did not start (`not-run`: too little of the budget left) has no run."""
    runs = results.setdefault("runs", {})
    for name, code in codes.items():
        if code == "not-run" and name not in runs:
            runs[name] = {"status": "skipped", "reason": "not run: too little of the time budget was left"}
    for name, run in runs.items():
        if run.get("status") == "running":
            code = codes.get(name)
            reason = "killed at its time limit" if code in ("124", "137") else f"exited with {code}"
            run.update(status="failed", reason=reason)


def render(args: argparse.Namespace) -> int:
    results = load(args.results)
    codes = {name: code for name, _, code in (p.partition("=") for p in args.phase_rc)}
    mark_unfinished(results, codes)
    results.setdefault("ended", time.time())
    save(args.results, results)
    out = Path(args.out)
    text = out.read_text() if out.exists() else ""
    out.write_text(gpu_report.replace_section(text, gpu_report.section(results)))
    found = gpu_report.problems(results)
    for problem in found:
        print(f"gpu-check: FAILED {problem}")
    verdict = "failed" if found else "ok"
    print(f"gpu-check: {verdict}; the One GPU section of {out} rewritten from {args.results}")
    return 1 if found else 0


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    phases = main.add_subparsers(dest="phase", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--results", type=Path, default=RESULTS)
    common.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    first = phases.add_parser("start", parents=[common])
    first.add_argument("--command", default="bash bench/gpu_check.sh")
    first.add_argument("--budget-s", type=int, default=480)
    first.add_argument("--wheels", default="none needed", help="what the shell script installed")
    phases.add_parser("tests", parents=[common]).add_argument("--timeout-s", type=int, default=90)
    run = phases.add_parser("train", parents=[common])
    run.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    run.add_argument("--size", choices=sorted(SIZES), help="default: the largest that fits (bf16)")
    run.add_argument("--micro", type=int)
    run.add_argument("--steps", type=int)
    run.add_argument("--budget-s", type=float, default=220, help="stop timing steps after this")
    run.add_argument("--no-compile", action="store_true")
    out = phases.add_parser("render", parents=[common])
    out.add_argument("--out", default=str(REPO / "BENCHMARKS.md"))
    out.add_argument("--phase-rc", nargs="*", default=[], help="NAME=EXIT of the train phases")
    return main


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    phase = {"start": start, "tests": tests, "train": train, "render": render}[args.phase]
    return phase(args)


if __name__ == "__main__":
    sys.exit(main())
