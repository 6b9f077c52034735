"""BENCHMARKS.md's "One GPU" section, from the results bench/gpu_check.py saved
(bench/results_gpu.json), and the check's verdict. Pure: no torch, no GPU."""

from __future__ import annotations

import statistics
import time
from typing import Any

from bench.gpu_sizing import LADDER, loss_fell, mfu, steady, tokens_per_s
from bench.report import RECOVERY_SECTION, fmt, summarise

SECTION = "## One GPU"
GIB = 2**30
ESTIMATE_TOLERANCE = 0.25  # as tests/unit/test_gpu_monitoring.py allows


def replace_section(text: str, section: list[str]) -> str:
    """`text` with its One GPU section (heading to the next `## ` heading) replaced by
    `section`; without one, the section goes before the recovery section (bench/run.py and
    bench/recovery.py keep what is there), else at the end. Everything else is unchanged."""
    body = "\n".join(section).strip("\n") + "\n"
    lines = text.splitlines(keepends=True)
    heading = next((i for i, line in enumerate(lines) if line.rstrip() == SECTION), None)
    if heading is not None:
        after = next((i for i in range(heading + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        rest = "".join(lines[after:])
        return "".join(lines[:heading]) + body + ("\n" + rest if rest else "")
    recovery = next((i for i, line in enumerate(lines) if line.rstrip() == RECOVERY_SECTION), None)
    if recovery is not None:
        return "".join(lines[:recovery]) + body + "\n" + "".join(lines[recovery:])
    return (text.rstrip("\n") + "\n\n" if text.strip() else "") + body


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value / GIB:.1f}"


def machine_line(results: dict[str, Any]) -> str:
    m = results["machine"]
    at = time.strftime("%Y-%m-%d %H:%M", time.gmtime(results["began"]))
    took = results.get("ended", results["began"]) - results["began"]
    wheels = results.get("wheels", "none needed")
    installed = "" if wheels == "none needed" else f" Installed for the check: {wheels}."
    return (
        f"`{results['command']}` (`make gpu-check`), {at} UTC, {took:.0f} s in all (budget "
        f"{results['budget_s']} s), on {m['gpu']} ({_gib(m['memory_bytes'])} GiB, CUDA capability "
        f"{m['capability']}), driver {m['driver']}; Python {m['python']}, torch {m['torch']}, CUDA "
        f"{m['cuda']}; {m['cpus']} CPU cores. shoal's Engine and GPT driven directly, without Ray or "
        f"MLflow (bench/gpu_check.py), on synthetic token windows made on the device.{installed}"
    )


def tests_line(tests: dict[str, Any] | None) -> str:
    if not tests:
        return "GPU-gated tests: not run."
    return f"GPU-gated tests, `{tests['command']}`: {tests['summary']} (exit {tests['returncode']})."


def model_line(results: dict[str, Any]) -> str:
    choice = results.get("choice") or {}
    run = _first_ok(results) or {}
    if not run:
        return "No run trained (see the rows)."
    args = run["args"]
    estimates = ", ".join(f"{name} {_gib(value)}" for name, value in choice.get("estimates", {}).items())
    chosen = (
        f"chosen as the largest of {', '.join(s.name for s in LADDER)} whose planner estimate fits "
        f"{_gib(choice['usable_bytes'])} GiB (`shoal plan`'s usable share of this GPU; estimates in GiB: "
        f"{estimates})"
        if choice.get("usable_bytes")
        else "size given on the command line"
    )
    if choice.get("size") not in (None, run["size"]):
        chosen += f"; the planner's choice, {choice['size']}, did not train (see below)"
    return (
        f"Model: the {run['size']} GPT ({run['parameters'] / 1e6:,.4g}M parameters: {args['n_layers']} "
        f"layers, d_model {args['d_model']}, {args['n_heads']} heads, vocab {args['vocab_size']:,}, "
        f"seq {args['seq_len']:,}), {chosen}. `parallel.strategy: fsdp` on one GPU (dp_shard 1: no "
        f"sharding, bf16 through autocast), `train.compile: {str(run['compile']).lower()}`, AdamW, "
        f"micro-batch {run['micro']} = {run['tokens_per_step']:,} tokens a step."
    )


def _first_ok(results: dict[str, Any]) -> dict[str, Any] | None:
    runs = results.get("runs", {})
    return next((r for r in runs.values() if r.get("status") == "ok"), None)


def run_row(precision: str, run: dict[str, Any]) -> str:
    status = run.get("status")
    if status != "ok":
        why = {"running": "did not finish within its time limit"}.get(status, run.get("reason") or "")
        return f"| {precision} | {status}: {why} |" + " |" * 8
    timed = steady(run["step_seconds"], run["warmup"])
    speed = tokens_per_s(timed, run["tokens_per_step"])
    util = (
        summarise([100 * mfu(run["flops_per_step"], s, run["peak_flops"]) for s in timed]) + " %"
        if run.get("peak_flops")
        else "n/a (GPU not in the catalog)"
    )
    first, last, _ = loss_fell(run["losses"])
    estimate, peak = run["estimate_bytes"], run.get("peak_bytes")
    ratio = f"{estimate / peak:.2f}" if peak else "n/a"
    micro = "" if run["micro"] == 8 else f" (micro-batch {run['micro']})"
    return (
        f"| {precision}{micro} | {len(timed)} | {summarise(speed)} | {util} | {summarise(timed)} | "
        f"{run['step_seconds'][0]:.1f} | {_gib(peak)} | {_gib(estimate)} | {ratio} | "
        f"{first:.2f} -> {last:.2f} |"
    )


def notes(results: dict[str, Any]) -> list[str]:
    runs = results.get("runs", {})
    ok = {name: r for name, r in runs.items() if r.get("status") == "ok"}
    lines = []
    if "bf16" in ok and "fp8" in ok:
        speeds = {name: median_tokens_per_s(run) for name, run in ok.items()}
        fell = loss_fell(ok["fp8"]["losses"])[2]
        lines.append(
            f"fp8 / bf16 tokens/s (medians): {speeds['fp8'] / speeds['bf16']:.2f}; fp8 loss fell "
            f"(mean of the first 5 steps -> the last 5): {'yes' if fell else 'NO'}."
        )
    run = ok.get("bf16") or next(iter(ok.values()), None)
    if run is not None:
        lines.append(
            f"MFU = model FLOPs per step ({fmt(run['flops_per_step'] / 1e12)} TFLOP, traced on the meta "
            f"device as `shoal plan` does) / step time / {run.get('peak_name') or 'no catalog peak'}; "
            f"medians (min-max) over the timed steps, after {run['warmup']} warm-up steps (compile runs "
            "in the first)."
        )
    if run is not None and run.get("peak_bytes"):
        lines.append(
            "Peak memory: `torch.cuda.max_memory_allocated` over the whole run; the planner's estimate "
            f"is within {ESTIMATE_TOLERANCE:.0%} of it: {'yes' if estimate_ok(run) else 'NO'}."
        )
    lines += [f"{name}: {note}" for name, r in runs.items() for note in r.get("attempts", [])]
    return lines


def median_tokens_per_s(run: dict[str, Any]) -> float:
    return statistics.median(tokens_per_s(steady(run["step_seconds"], run["warmup"]), run["tokens_per_step"]))


def estimate_ok(run: dict[str, Any]) -> bool:
    peak = run.get("peak_bytes")
    return bool(peak) and abs(run["estimate_bytes"] / peak - 1) <= ESTIMATE_TOLERANCE


def section(results: dict[str, Any]) -> list[str]:
    runs = results.get("runs", {})
    return [
        SECTION,
        "",
        machine_line(results),
        "",
        tests_line(results.get("tests")),
        "",
        model_line(results),
        "",
        "| precision | steps timed | tokens/s | MFU | step (s) | first step, compile (s) | peak memory (GiB) "
        "| planner estimate (GiB) | estimate / peak | loss, first 5 -> last 5 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(run_row(name, runs[name]) for name in ("bf16", "fp8") if name in runs),
        *(line for note in notes(results) for line in ("", note)),
    ]


def problems(results: dict[str, Any]) -> list[str]:
    """What failed: `make gpu-check` exits 1 when this is not empty. The bf16 run must train and
    its loss fall; an fp8 run that did not run (no torchao, a GPU below capability 8.9, no time
    left) is reported, not a failure, but one that ran must train and its loss fall."""
    found = []
    tests = results.get("tests") or {}
    if tests.get("returncode") != 0 or "passed" not in tests.get("summary", ""):
        found.append(f"GPU-gated tests: {tests.get('summary') or 'not run'}")  # all skipped counts too
    runs = results.get("runs", {})
    for name in ("bf16", "fp8"):
        run = runs.get(name) or {"status": "missing", "reason": "not run"}
        if run["status"] == "skipped" and name == "fp8":
            continue
        if run["status"] != "ok":
            found.append(f"{name}: {run['status']}: {run.get('reason') or 'no result'}")
        elif not loss_fell(run["losses"])[2]:
            found.append(f"{name}: the loss did not fall (mean of the first 5 steps vs the last 5)")
    return found
