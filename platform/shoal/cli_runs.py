"""`shoal runs list | show | compare`: what MLflow recorded of shoal runs, as tables
that fit the terminal or, with `--format json`, as the same data for scripts.

Each command first shapes the runs into plain data (JSON types, times in ISO 8601);
the table is drawn from that data, so the two never disagree.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from shoal.cli_options import SharedOptions
from shoal.output import Col, FittedTable, Fold, cell_width, iso_time, print_json

if TYPE_CHECKING:
    from mlflow.entities import Run

    from shoal.tracking.browse import RunDetails

JSON_HINT = "--format json has all"
LIST_COLUMNS = (
    Col("run id", fold=Fold.NEVER),  # whole, to be copied (shoal resume RUN_ID)
    Col("name", min_width=16),
    Col("experiment", priority=5),
    Col("status", fold=Fold.NEVER),
    Col("step", priority=2, fold=Fold.NEVER, justify="right"),
    Col("started", priority=3, fold=Fold.NEVER),
    Col("loss", priority=1, fold=Fold.NEVER, justify="right"),
    Col("val loss", priority=1, fold=Fold.NEVER, justify="right"),
    Col("val acc", priority=1, fold=Fold.NEVER, justify="right"),
    Col("samples/s", priority=4, fold=Fold.NEVER, justify="right"),
    Col("MFU", priority=4, fold=Fold.NEVER, justify="right"),
)
COMPARE_MIN_WIDTH = 12  # each run's column; more runs than fit go to the next table
COMPARE_KEY_WIDTH = 24  # the column of parameter and metric names folds beyond this


def add_parser(commands: Any, shared: SharedOptions) -> None:
    runs = commands.add_parser("runs", help="browse runs in MLflow: list | show RUN | compare RUN RUN ...")
    actions = runs.add_subparsers(dest="runs_command", required=True)
    common = [shared.tracking_uri, shared.output_format]
    listing = actions.add_parser("list", help="shoal's runs, newest first", parents=common)
    listing.add_argument("--experiment", help="only this MLflow experiment")
    listing.add_argument("--limit", type=int, default=50)
    show = actions.add_parser(
        "show", help="params, final metrics, events, checkpoints and attempts of a run", parents=common
    )
    show.add_argument("run", help="run id or run name")
    compare = actions.add_parser(
        "compare", help="runs side by side: differing params and final metrics", parents=common
    )
    compare.add_argument("run", nargs="+", help="run ids or run names")


def cmd_runs(console: Console, args: argparse.Namespace) -> int:
    # deferred: the tracking layer imports MLflow (~2 s); `shoal --help` needs none of it
    from shoal.tracking import resolve_uri

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = resolve_uri(args.tracking_uri)
    if args.runs_command == "list":
        rows = list_data(uri, args.experiment, args.limit)
        if args.format == "json":
            print_json(console, rows)
        else:
            console.print(list_table(rows, uri) if rows else f"no shoal runs at {uri}")
    elif args.runs_command == "show":
        data = show_data(uri, args.run)
        if args.format == "json":
            print_json(console, data)
        else:
            for table in show_tables(data):
                console.print(table)
    else:
        data = compare_data(uri, args.run)
        if args.format == "json":
            print_json(console, data)
        else:
            for table in compare_tables(data, console.width):
                console.print(table)
            console.print("[cyan]cyan[/]: parameters that differ; the rest: final metrics")
    return 0


def value_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


def shown_time(iso: str | None) -> str:
    """An ISO time of this data as the tables show it: local, to the second."""
    return iso[:19].replace("T", " ") if iso else "-"


def list_data(uri: str, experiment: str | None, limit: int) -> list[dict[str, Any]]:
    # deferred: the tracking layer imports MLflow (~2 s); `shoal --help` needs none of it
    from shoal.tracking.browse import HEADLINE, last_step, list_runs, run_name

    return [
        {
            "run_id": run.info.run_id,
            "name": run_name(run),
            "experiment": experiment_name,
            "status": run.info.status,
            "step": last_step(run),
            "start_time": iso_time(run.info.start_time),
            "metrics": {key: run.data.metrics.get(key) for key in HEADLINE},
        }
        for run, experiment_name in list_runs(uri, experiment, limit)
    ]


def list_table(rows: list[dict[str, Any]], uri: str) -> FittedTable:
    cells = [
        [
            row["run_id"],
            escape(row["name"]),
            escape(row["experiment"]),
            row["status"],
            str(row["step"]),
            shown_time(row["start_time"]),
            *[value_text(v) for v in row["metrics"].values()],
        ]
        for row in rows
    ]
    return FittedTable(LIST_COLUMNS, cells, f"shoal runs at {uri}", left_out_hint=JSON_HINT)


def _checkpoints(details: RunDetails) -> tuple[list[str], str | None]:
    """The run's checkpoint paths, or why they cannot be listed."""
    # deferred: the tracking layer imports MLflow (~2 s); `shoal --help` needs none of it
    from shoal.launch.storage import StorageError, open_storage

    if not details.run_dir:
        return [], None
    root, name = details.run_dir.rsplit("/", 1)
    try:
        storage = open_storage(root, details.run.data.params.get("checkpoint.endpoint") or None)
        return [f"{details.run_dir}/{path}" for path in storage.checkpoints(name)], None
    except (StorageError, OSError) as exc:
        return [], f"cannot list {details.run_dir}: {exc}"


def show_data(uri: str, ref: str) -> dict[str, Any]:
    # deferred: the tracking layer imports MLflow (~2 s); `shoal --help` needs none of it
    from shoal.tracking.browse import metric_keys, run_details

    details = run_details(uri, ref)
    run = details.run
    checkpoints, checkpoints_error = _checkpoints(details)
    tags = run.data.tags
    return {
        "run_id": run.info.run_id,
        "name": details.name,
        "experiment": details.experiment,
        "status": run.info.status,
        "steps": details.steps,
        "start_time": iso_time(run.info.start_time),
        "end_time": iso_time(run.info.end_time),
        "duration_s": _duration_s(run),
        "run_dir": details.run_dir,
        "device": tags.get("shoal.device_name") or tags.get("shoal.device"),
        "metrics": {key: run.data.metrics[key] for key in metric_keys([run])},
        "attempts": [_attempt(event) for event in details.attempts],
        "events": details.events,
        "checkpoints": checkpoints,
        "checkpoints_error": checkpoints_error,
        "params": dict(sorted(run.data.params.items())),
    }


def _duration_s(run: Run) -> int:
    end = run.info.end_time or int(time.time() * 1000)
    return max(0, (end - run.info.start_time) // 1000)


def _attempt(event: dict[str, Any]) -> dict[str, Any]:
    return {
        "started": iso_time(int(event["time"] * 1000)),
        "world_size": event.get("world_size"),
        "device": event.get("device_name") or event.get("device"),
        "precision": (event.get("parallel") or {}).get("precision"),  # `auto` as it was resolved
        "restored_step": event.get("restored_step"),
    }


def _hms(seconds: int) -> str:
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _event_text(event: dict[str, Any]) -> str:
    skip = {"kind", "time", "parameters", "parallel", "errors"}
    fields = [f"{k}={v}" for k, v in event.items() if k not in skip and v is not None]
    if "errors" in event:
        fields += [f"rank {r}: {str(e).splitlines()[0][:120]}" for r, e in event["errors"].items()]
    return ", ".join(fields)


def _key_value(title: str, pairs: list[tuple[str, str]]) -> FittedTable:
    columns = (Col("", fold=Fold.NEVER, style="bold"), Col("", fold=Fold.FREELY, min_width=20))
    return FittedTable(columns, pairs, title, show_header=False)


def show_tables(data: dict[str, Any]) -> list[FittedTable]:
    head = _key_value(
        f"run {escape(data['name'])}",
        [
            ("run id", data["run_id"]),
            ("experiment", escape(data["experiment"])),
            ("status", data["status"]),
            ("steps", str(data["steps"])),
            ("started", shown_time(data["start_time"])),
            ("duration", _hms(data["duration_s"])),
            ("run directory", escape(data["run_dir"] or "-")),
            ("device", escape(data["device"] or "-")),
        ],
    )
    metrics = FittedTable(
        (Col("metric", min_width=16), Col("value", fold=Fold.NEVER, justify="right")),
        [(escape(k), value_text(v)) for k, v in data["metrics"].items()],
        "final metrics",
    )
    attempt_columns = ("#", "started", "workers", "device", "precision", "restored from step")
    attempts = FittedTable(
        [Col(c, fold=Fold.NEVER if c in ("#", "started") else Fold.LAST) for c in attempt_columns],
        [
            (
                str(n),
                shown_time(a["started"]),
                str(a["world_size"]),
                escape(str(a["device"])),
                a.get("precision") or "-",
                _or_dash(a),
            )
            for n, a in enumerate(data["attempts"], 1)
        ],
        "attempts",
    )
    events = FittedTable(
        (
            Col("time", fold=Fold.NEVER),
            Col("event", min_width=12),
            Col("details", fold=Fold.FREELY, min_width=20),
        ),
        [
            (shown_time(iso_time(int(e["time"] * 1000))), escape(e["kind"]), escape(_event_text(e)))
            for e in data["events"]
        ],
        "events",
    )
    found = [escape(p) for p in data["checkpoints"]]
    if data["checkpoints_error"]:
        found.append(escape(data["checkpoints_error"]))
    checkpoints = FittedTable([Col("path", fold=Fold.FREELY)], [[p] for p in found], "checkpoints")
    params = FittedTable(
        (Col("param", min_width=16), Col("value", fold=Fold.FREELY, min_width=20)),
        [(escape(k), escape(v)) for k, v in data["params"].items()],
        "params",
    )
    return [head, metrics, attempts, events, checkpoints, params]


def _or_dash(attempt: dict[str, Any]) -> str:
    restored = attempt["restored_step"]
    return "-" if restored is None else str(restored)


def compare_data(uri: str, refs: list[str]) -> list[dict[str, Any]]:
    # deferred: the tracking layer imports MLflow (~2 s); `shoal --help` needs none of it
    from shoal.tracking.browse import differing_params, metric_keys, run_details

    found = [run_details(uri, ref) for ref in refs]
    runs = [d.run for d in found]
    params, metrics = differing_params(runs), metric_keys(runs)
    return [
        {
            "run_id": d.run.info.run_id,
            "name": d.name,
            "status": d.run.info.status,
            "steps": d.steps,
            "params": {key: d.run.data.params.get(key) for key in params},
            "metrics": {key: d.run.data.metrics.get(key) for key in metrics},
        }
        for d in found
    ]


def compare_tables(runs: list[dict[str, Any]], width: int) -> list[FittedTable]:
    """Runs side by side, as many per table as `width` holds at COMPARE_MIN_WIDTH each."""
    keys = [*runs[0]["params"], *runs[0]["metrics"]]
    key_width = min(COMPARE_KEY_WIDTH, max(map(cell_width, ["status", "steps", *keys])))
    per_table = max(1, (width - 1 - key_width - 3) // (COMPARE_MIN_WIDTH + 3))
    return [_compare_table(runs[start : start + per_table]) for start in range(0, len(runs), per_table)]


def _compare_table(runs: list[dict[str, Any]]) -> FittedTable:
    columns = [Col("", min_width=COMPARE_KEY_WIDTH)]
    columns += [Col(f"{escape(r['name'])}\n{r['run_id'][:8]}", min_width=COMPARE_MIN_WIDTH) for r in runs]
    rows = [["status", *[r["status"] for r in runs]], ["steps", *[str(r["steps"]) for r in runs]]]
    for key in runs[0]["params"]:
        values = [escape(r["params"][key] if r["params"][key] is not None else "-") for r in runs]
        rows.append([f"[cyan]{escape(key)}[/]", *[f"[cyan]{v}[/]" for v in values]])
    for key in runs[0]["metrics"]:
        rows.append([escape(key), *[value_text(r["metrics"][key]) for r in runs]])
    return FittedTable(columns, rows, "compare")
