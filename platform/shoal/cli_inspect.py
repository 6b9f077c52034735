"""The looking-around half of the `shoal` command: `plan` and `doctor` (`runs` is in
cli_runs.py). Kept apart from cli.py (which trains) so that each stays short; same
rules: parse, call the Python API, print (a table, or with `--format json` its data).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from shoal.cli_options import SharedOptions
from shoal.output import Col, FittedTable, Fold, print_json
from shoal.plan.catalog import CATALOG, INTERCONNECTS


def add_parsers(commands: Any, shared: SharedOptions) -> None:
    plan = commands.add_parser(
        "plan",
        help="memory per GPU and the simplest layout that fits",
        parents=[shared.overrides, shared.output_format],
    )
    plan.add_argument("file", help="workload YAML")
    plan.add_argument("--gpu", required=True, choices=list(CATALOG))
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    plan.add_argument("--nodes", type=int, default=1)
    plan.add_argument(
        "--interconnect", choices=INTERCONNECTS, help="default: nvlink where the GPU has it, else pcie"
    )
    plan.add_argument(
        "--write", metavar="OUT.yaml", help="write the workload with the recommendation applied"
    )
    doctor = commands.add_parser(
        "doctor",
        help="check this machine, a Ray cluster and MLflow",
        parents=[shared.overrides, shared.output_format],
    )
    doctor.add_argument("--address", help="Ray cluster to inspect (HOST:PORT); default: none")
    doctor.add_argument("file", nargs="?", help="a workload: check its tracking URI and checkpoint storage")


def _gb(value: float) -> str:
    """Bytes in the unit that shows them best (GB = 10^9 bytes, as GPUs are sold)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


SIZES = ("weights", "gradients", "optimizer", "activations", "activations_full_checkpointing", "peak")
PLAN_COLUMNS = (
    Col("layout", min_width=14),
    Col("micro", priority=1, fold=Fold.NEVER, justify="right"),
    Col("accum", priority=2, fold=Fold.NEVER, justify="right"),
    Col("checkpointing", priority=2, min_width=13),
    # sizes ("5.03 MB") are at most 7 wide; wider headers fold
    Col("weights", priority=4, min_width=7, justify="right"),
    Col("grads", priority=4, min_width=7, justify="right"),
    Col("optimizer", priority=4, min_width=7, justify="right"),
    Col("activations", priority=3, min_width=7, justify="right"),
    Col("act. full ckpt", priority=5, fold=Fold.FREELY, min_width=7, justify="right"),
    Col("peak", min_width=7, justify="right"),
    Col("fits", fold=Fold.FREELY, min_width=16),
)
DOCTOR_STATUS = {"✓": "ok", "✗": "failed", "!": "warning", "–": "not applicable"}


def _option_data(plan: Any, option: Any) -> dict[str, Any]:
    # deferred: shoal.plan imports torch and the model registry; `shoal --help` needs neither
    from shoal.plan.memory import estimate

    data = {
        "strategy": option.layout.strategy,
        "layout": option.layout.describe(),
        "degrees": {k: getattr(option.layout, k) for k in ("pp", "dp_replicate", "dp_shard", "tp")},
        "micro": option.micro,
        "accumulation": option.accumulation,
        "activation_checkpointing": option.activation_checkpointing,
        "fits": option.fits,
        "problem": option.problem,
        "warnings": list(option.warnings),
        "bytes_per_gpu": None,
    }
    if (found := option.estimate) is not None:
        checkpointed = replace(plan.training, activation_checkpointing="full")
        full = estimate(plan.cost, option.layout, checkpointed, option.micro)
        values = (found.weights, found.gradients, found.optimizer, found.activations, full.activations)
        data["bytes_per_gpu"] = dict(zip(SIZES, (*values, found.peak), strict=True))
    return data


def _by_precision(plan: Any, workload: Any) -> list[dict[str, Any]]:
    """The recommended layout's peak at each precision (fp8 keeps bf16 activations)."""
    # deferred: shoal.plan imports torch and the model registry; `shoal --help` needs neither
    from shoal.plan.memory import estimate
    from shoal.plan.planner import model_cost

    option, rows = plan.choice, []
    for precision in ("fp32", "bf16", "fp8"):
        cost = model_cost(workload, precision)
        training = replace(
            plan.training, precision=precision, activation_checkpointing=option.activation_checkpointing
        )
        found = estimate(cost, option.layout, training, option.micro)
        rows.append(
            {
                "precision": precision,
                "weights": found.weights,
                "activations": found.activations,
                "peak": found.peak,
            }
        )
    return rows


def plan_data(plan: Any, workload: Any) -> dict[str, Any]:
    """The plan as plain data: what the tables show, sizes in bytes per GPU."""
    options = [_option_data(plan, option) for option in plan.options]
    chosen = next((i for i, option in enumerate(plan.options) if option is plan.choice), None)
    return {
        "gpu": plan.gpu.name,
        "gpus": plan.gpus,
        "nodes": plan.nodes,
        "interconnect": plan.interconnect,
        "parameters": plan.cost.parameters,
        "precision": plan.training.precision,  # `auto` as the workers would resolve it on this GPU
        "asked_precision": plan.asked_precision,
        "precision_warning": plan.precision_warning,
        "global_batch": plan.global_batch,
        "usable_bytes_per_gpu": plan.usable_bytes,
        "options": options,
        "recommended": None if chosen is None else options[chosen],
        "by_precision": [] if chosen is None else _by_precision(plan, workload),
    }


def _layout(option: dict[str, Any]) -> str:
    return escape(f"{option['strategy']} {option['layout']}")


def _plan_row(option: dict[str, Any], chosen: bool) -> list[str]:
    layout = f"{'[bold]' if chosen else ''}{_layout(option)}"
    sizes = option["bytes_per_gpu"]
    if sizes is None:
        return [layout, *["-"] * 9, escape(option["problem"])]
    fits = "[green]yes[/]" if option["fits"] else f"[red]no[/] {escape(option['problem'])}"
    counts = [str(option["micro"]), str(option["accumulation"]), option["activation_checkpointing"]]
    return [layout, *counts, *[_gb(sizes[key]) for key in SIZES], fits]


def _precision(data: dict[str, Any]) -> str:
    asked = data.get("asked_precision")
    return f"{data['precision']} ({asked})" if asked and asked != data["precision"] else data["precision"]


def plan_tables(data: dict[str, Any]) -> list[FittedTable]:
    title = (
        f"{data['gpus']} x {data['gpu']} ({data['nodes']} node(s), {data['interconnect']}); "
        f"{data['parameters']:,} parameters, {_precision(data)}, global batch {data['global_batch']}; "
        f"per GPU, {data['usable_bytes_per_gpu'] / 1e9:.1f} GB usable"
    )
    rows = [_plan_row(option, option is data["recommended"]) for option in data["options"]]
    tables = [FittedTable(PLAN_COLUMNS, rows, title, left_out_hint="--format json has all")]
    if (choice := data["recommended"]) is not None:
        columns = [Col("precision")] + [
            Col(c, justify="right") for c in ("weights", "activations", "peak per GPU")
        ]
        rows = [
            [row["precision"], _gb(row["weights"]), _gb(row["activations"]), _gb(row["peak"])]
            for row in data["by_precision"]
        ]
        tables.append(FittedTable(columns, rows, f"{_layout(choice)} by precision"))
    return tables


def _print_plan(console: Console, data: dict[str, Any]) -> None:
    main_table, *by_precision = plan_tables(data)
    console.print(main_table)
    if data["precision_warning"]:
        console.print(f"[yellow]warning[/] {escape(data['precision_warning'])}", soft_wrap=True)
    for option in data["options"]:
        for warning in option["warnings"]:
            console.print(f"[yellow]warning[/] {_layout(option)}: {escape(warning)}")
    if (choice := data["recommended"]) is None:
        console.print("[red]nothing fits[/]: more GPUs, a larger GPU, or a smaller micro-batch/model")
        return
    console.print(
        f"recommended: [bold]{choice['strategy']}[/] ({choice['layout']}), micro-batch "
        f"{choice['micro']} per data-parallel slot x accumulation {choice['accumulation']}, "
        f"activation checkpointing {choice['activation_checkpointing']}: "
        f"{_gb(choice['bytes_per_gpu']['peak'])} per GPU"
    )
    for table in by_precision:
        console.print(table)


def cmd_plan(console: Console, args: argparse.Namespace) -> int:
    # deferred: shoal.plan imports torch and the model registry; `shoal --help` needs neither
    from shoal.plan.planner import make_plan, planned_yaml
    from shoal.spec import load

    loaded = load(args.file, args.overrides)
    plan = make_plan(loaded.workload, args.gpu, args.gpus, args.nodes, args.interconnect)
    data = plan_data(plan, loaded.workload)
    data["wrote"] = None
    if plan.choice is not None and args.write:
        text = planned_yaml(args.file, args.overrides, plan)
        target = Path(args.write)
        partial = target.with_name(f".{target.name}.partial")
        partial.write_text(text)
        partial.replace(target)
        data["wrote"] = str(target)
    if args.format == "json":
        print_json(console, data)
    else:
        _print_plan(console, data)
        if data["wrote"]:
            console.print(f"wrote {data['wrote']}: shoal run {data['wrote']}")
    return 0 if plan.choice is not None else 1


def doctor_data(args: argparse.Namespace) -> list[dict[str, str]]:
    # deferred: shoal.plan imports torch and the model registry; `shoal --help` needs neither
    from shoal.plan.doctor import run_checks
    from shoal.tracking import resolve_uri

    storage, endpoint, uri = "./shoal_runs", None, resolve_uri(None)
    precision, gpus = None, 0.0
    if args.file:
        from shoal.spec import load

        workload = load(args.file, args.overrides).workload
        storage, endpoint = workload.checkpoint.storage, workload.checkpoint.endpoint
        uri = resolve_uri(workload.tracking.uri)
        precision, gpus = workload.train.precision, workload.scaling.gpus_per_worker
    return [
        {"check": c.name, "status": DOCTOR_STATUS[c.mark], "found": c.detail, "hint": c.hint}
        for c in run_checks(args.address, uri, storage, endpoint, precision, gpus)
    ]


def doctor_table(checks: list[dict[str, str]]) -> FittedTable:
    marks = {
        "ok": "[green]✓[/]",
        "failed": "[red]✗[/]",
        "warning": "[yellow]![/]",
        "not applicable": "[dim]–[/]",
    }
    columns = (
        Col("", fold=Fold.NEVER),
        Col("check", fold=Fold.NEVER),
        Col("found", fold=Fold.FREELY, min_width=20),
        Col("hint", fold=Fold.FREELY),
    )
    rows = [[marks[c["status"]], c["check"], escape(c["found"]), escape(c["hint"])] for c in checks]
    return FittedTable(columns, rows, "shoal doctor")


def cmd_doctor(console: Console, args: argparse.Namespace) -> int:
    checks = doctor_data(args)
    failed = [c["check"] for c in checks if c["status"] == "failed"]
    if args.format == "json":
        print_json(console, checks)
    else:
        console.print(doctor_table(checks))
        console.print(
            f"[red]{len(failed)} check(s) failed: {', '.join(failed)}[/]" if failed else "[green]ready[/]"
        )
    return 1 if failed else 0
