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
