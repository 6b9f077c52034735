"""The looking-around half of the `shoal` command: `runs`, `plan`, `doctor`.

Kept apart from cli.py (which trains) so that each stays short; same rules: parse,
call the Python API, print.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

TRACKING_HELP = "MLflow tracking URI (default: $MLFLOW_TRACKING_URI or ./mlflow.db)"


def add_parsers(commands: Any) -> None:
    from shoal.plan.catalog import CATALOG
    from shoal.plan.planner import INTERCONNECTS

    plan = commands.add_parser("plan", help="memory per GPU and the simplest layout that fits")
    plan.add_argument("file", help="workload YAML")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--gpu", required=True, choices=list(CATALOG))
    plan.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    plan.add_argument("--nodes", type=int, default=1)
    plan.add_argument(
        "--interconnect", choices=INTERCONNECTS, help="default: nvlink where the GPU has it, else pcie"
    )
    plan.add_argument(
        "--write", metavar="OUT.yaml", help="write the workload with the recommendation applied"
    )
    doctor = commands.add_parser("doctor", help="check this machine, a Ray cluster and MLflow")
    doctor.add_argument("--address", help="Ray cluster to inspect (HOST:PORT); default: none")
    doctor.add_argument("--set", dest="overrides", action="append", default=[], help=argparse.SUPPRESS)
    doctor.add_argument("file", nargs="?", help="a workload: check its tracking URI and checkpoint storage")

    runs = commands.add_parser("runs", help="browse runs in MLflow: list | show RUN | compare RUN RUN ...")
    actions = runs.add_subparsers(dest="runs_command", required=True)
    listing = actions.add_parser("list", help="shoal's runs, newest first")
    listing.add_argument("--experiment", help="only this MLflow experiment")
    listing.add_argument("--limit", type=int, default=50)
    show = actions.add_parser("show", help="params, final metrics, events, checkpoints and attempts of a run")
    show.add_argument("run", help="run id or run name")
    compare = actions.add_parser("compare", help="runs side by side: differing params and final metrics")
    compare.add_argument("run", nargs="+", help="run ids or run names")
    for parser in (listing, show, compare):
        parser.add_argument("--tracking-uri", help=TRACKING_HELP)


def _when(millis: int | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(millis / 1000)) if millis else "-"


def _duration(run: Any) -> str:
    end = run.info.end_time or int(time.time() * 1000)
    seconds = max(0, (end - run.info.start_time) // 1000)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _value(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def runs_list(console: Console, uri: str, experiment: str | None, limit: int) -> None:
    from shoal.tracking.browse import HEADLINE, last_step, list_runs

    found = list_runs(uri, experiment, limit)
    table = Table(title=f"shoal runs at {uri}", title_justify="left")
    headers = ("loss", "val loss", "val acc", "samples/s", "MFU")
    for column in ("run id", "name", "experiment", "status", "step", "started", *headers):
        table.add_column(column, overflow="fold", no_wrap=column in ("run id", "started"))
    for run, experiment_name in found:
        metrics, tags = run.data.metrics, run.data.tags
        table.add_row(
            run.info.run_id,
            tags.get("shoal.run_name") or run.info.run_name,
            experiment_name,
            run.info.status,
            str(last_step(run)),
            _when(run.info.start_time),
            *[_value(metrics.get(key)) for key in HEADLINE],
        )
    console.print(table if found else f"no shoal runs at {uri}")


def _event_text(event: dict[str, Any]) -> str:
    skip = {"kind", "time", "parameters", "parallel", "errors"}
    fields = [f"{k}={v}" for k, v in event.items() if k not in skip and v is not None]
    if "errors" in event:
        fields += [f"rank {r}: {str(e).splitlines()[0][:120]}" for r, e in event["errors"].items()]
    return ", ".join(fields)


def runs_show(console: Console, uri: str, ref: str) -> None:
    from shoal.launch.storage import StorageError, open_storage
    from shoal.tracking.browse import metric_keys, run_details

    details = run_details(uri, ref)
    run = details.run
    head = Table(title=f"run {details.name}", show_header=False, title_justify="left")
    head.add_column(style="bold")
    head.add_column(overflow="fold")
    for key, value in (
        ("run id", run.info.run_id),
        ("experiment", details.experiment),
        ("status", run.info.status),
        ("steps", str(details.steps)),
        ("started", _when(run.info.start_time)),
        ("duration", _duration(run)),
        ("run directory", details.run_dir or "-"),
        ("device", run.data.tags.get("shoal.device_name") or run.data.tags.get("shoal.device") or "-"),
    ):
        head.add_row(key, value)
    console.print(head)
    metrics = Table(title="final metrics", title_justify="left")
    metrics.add_column("metric")
    metrics.add_column("value", justify="right")
    for key in metric_keys([run]):
        metrics.add_row(key, _value(run.data.metrics[key]))
    console.print(metrics)
    attempts = Table(title="attempts", title_justify="left")
    for column in ("#", "started", "workers", "device", "restored from step"):
        attempts.add_column(column)
    for number, event in enumerate(details.attempts, 1):
        restored = event.get("restored_step")
        attempts.add_row(
            str(number),
            _when(int(event["time"] * 1000)),
            str(event.get("world_size")),
            str(event.get("device_name") or event.get("device")),
            "-" if restored is None else str(restored),
        )
    console.print(attempts)
    timeline = Table(title="events", title_justify="left")
    for column in ("time", "event", "details"):
        timeline.add_column(column, overflow="fold")
    for event in details.events:
        timeline.add_row(_when(int(event["time"] * 1000)), event["kind"], escape(_event_text(event)))
    console.print(timeline)
    checkpoints = Table(title="checkpoints", title_justify="left")
    checkpoints.add_column("path", overflow="fold")
    if details.run_dir:
        root, name = details.run_dir.rsplit("/", 1)
        try:
            storage = open_storage(root, run.data.params.get("checkpoint.endpoint") or None)
            for path in storage.checkpoints(name):
                checkpoints.add_row(f"{details.run_dir}/{path}")
        except (StorageError, OSError) as exc:
            checkpoints.add_row(f"cannot list {details.run_dir}: {exc}")
    console.print(checkpoints)
    params = Table(title="params", title_justify="left")
    params.add_column("param")
    params.add_column("value", overflow="fold")
    for key, value in sorted(run.data.params.items()):
        params.add_row(key, escape(value))
    console.print(params)


def runs_compare(console: Console, uri: str, refs: list[str]) -> None:
    from shoal.tracking.browse import differing_params, metric_keys, run_details

    runs = [run_details(uri, ref) for ref in refs]
    table = Table(title="compare", title_justify="left")
    table.add_column("")
    for details in runs:
        table.add_column(f"{details.name}\n{details.run.info.run_id[:8]}", overflow="fold")
    table.add_row("status", *[d.run.info.status for d in runs])
    table.add_row("steps", *[str(d.steps) for d in runs])
    for key in differing_params([d.run for d in runs]):
        table.add_row(key, *[escape(d.run.data.params.get(key, "-")) for d in runs], style="cyan")
    for key in metric_keys([d.run for d in runs]):
        table.add_row(key, *[_value(d.run.data.metrics.get(key)) for d in runs])
    console.print(table)
    console.print("[cyan]cyan[/]: parameters that differ; the rest: final metrics")


def cmd_runs(console: Console, args: argparse.Namespace) -> int:
    import os

    from shoal.tracking import resolve_uri

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

    uri = resolve_uri(args.tracking_uri)
    if args.runs_command == "list":
        runs_list(console, uri, args.experiment, args.limit)
    elif args.runs_command == "show":
        runs_show(console, uri, args.run)
    else:
        runs_compare(console, uri, args.run)
    return 0


def _gb(value: float) -> str:
    """Bytes in the unit that shows them best (GB = 10^9 bytes, as GPUs are sold)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def plan_table(plan: Any) -> Table:
    from dataclasses import replace

    from shoal.plan.memory import estimate

    table = Table(
        title=f"{plan.gpus} x {plan.gpu.name} ({plan.nodes} node(s), {plan.interconnect}); "
        f"{plan.cost.parameters:,} parameters, {plan.training.precision}, global batch {plan.global_batch}; "
        f"per GPU, {plan.usable_bytes / 1e9:.1f} GB usable",
        title_justify="left",
    )
    columns = ("layout", "micro", "accum", "checkpointing", "weights", "grads", "optimizer")
    for column in (*columns, "activations", "act. full ckpt", "peak", "fits"):
        table.add_column(column, justify="left" if column in ("layout", "checkpointing", "fits") else "right")
    for option in plan.options:
        found = option.estimate
        if found is None:
            table.add_row(f"{option.layout.strategy} {option.layout.describe()}", *["-"] * 9, option.problem)
            continue
        checkpointed = replace(plan.training, activation_checkpointing="full")
        full = estimate(plan.cost, option.layout, checkpointed, option.micro)
        chosen = option is plan.choice
        table.add_row(
            f"{'[bold]' if chosen else ''}{option.layout.strategy} {option.layout.describe()}",
            str(option.micro),
            str(option.accumulation),
            option.activation_checkpointing,
            _gb(found.weights),
            _gb(found.gradients),
            _gb(found.optimizer),
            _gb(found.activations),
            _gb(full.activations),
            _gb(found.peak),
            "[green]yes[/]" if option.fits else f"[red]no[/] {option.problem}",
        )
    return table


def precision_table(plan: Any, workload: Any) -> Table:
    """The recommended layout's peak at each precision (fp8 keeps bf16 activations)."""
    from dataclasses import replace

    from shoal.plan.memory import estimate
    from shoal.plan.planner import model_cost

    option = plan.choice
    table = Table(
        title=f"{option.layout.strategy} {option.layout.describe()} by precision", title_justify="left"
    )
    for column in ("precision", "weights", "activations", "peak per GPU"):
        table.add_column(column, justify="left" if column == "precision" else "right")
    for precision in ("fp32", "bf16", "fp8"):
        cost = model_cost(workload, precision)
        training = replace(
            plan.training, precision=precision, activation_checkpointing=option.activation_checkpointing
        )
        found = estimate(cost, option.layout, training, option.micro)
        table.add_row(precision, _gb(found.weights), _gb(found.activations), _gb(found.peak))
    return table


def cmd_plan(console: Console, args: argparse.Namespace) -> int:
    from shoal.plan.planner import make_plan, planned_yaml
    from shoal.spec import load

    loaded = load(args.file, args.overrides)
    plan = make_plan(loaded.workload, args.gpu, args.gpus, args.nodes, args.interconnect)
    console.print(plan_table(plan))
    for option in plan.options:
        for warning in option.warnings:
            console.print(
                f"[yellow]warning[/] {option.layout.strategy} {option.layout.describe()}: {warning}"
            )
    choice = plan.choice
    if choice is None:
        console.print("[red]nothing fits[/]: more GPUs, a larger GPU, or a smaller micro-batch/model")
        return 1
    console.print(
        f"recommended: [bold]{choice.layout.strategy}[/] ({choice.layout.describe()}), micro-batch "
        f"{choice.micro} per data-parallel slot x accumulation {choice.accumulation}, "
        f"activation checkpointing {choice.activation_checkpointing}: "
        f"{_gb(choice.estimate.peak)} per GPU"
    )
    console.print(precision_table(plan, loaded.workload))
    if args.write:
        from pathlib import Path

        text = planned_yaml(args.file, args.overrides, plan)
        target = Path(args.write)
        partial = target.with_name(f".{target.name}.partial")
        partial.write_text(text)
        partial.replace(target)
        console.print(f"wrote {target}: shoal run {target}")
    return 0


def cmd_doctor(console: Console, args: argparse.Namespace) -> int:
    from shoal.plan.doctor import FAIL, run_checks
    from shoal.tracking import resolve_uri

    storage, endpoint, uri = "./shoal_runs", None, resolve_uri(None)
    if args.file:
        from shoal.spec import load

        workload = load(args.file, args.overrides).workload
        storage, endpoint = workload.checkpoint.storage, workload.checkpoint.endpoint
        uri = resolve_uri(workload.tracking.uri)
    checks = run_checks(args.address, uri, storage, endpoint)
    table = Table(title="shoal doctor", title_justify="left")
    for column in ("", "check", "found", "hint"):
        table.add_column(column, overflow="fold")
    colour = {"✓": "green", "✗": "red", "–": "dim"}
    for check in checks:
        table.add_row(f"[{colour[check.mark]}]{check.mark}[/]", check.name, escape(check.detail), check.hint)
    console.print(table)
    failed = [c.name for c in checks if c.mark == FAIL]
    console.print(
        f"[red]{len(failed)} check(s) failed: {', '.join(failed)}[/]" if failed else "[green]ready[/]"
    )
    return 1 if failed else 0
