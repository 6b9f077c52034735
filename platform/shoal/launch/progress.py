"""What a person sees in the terminal during and after `shoal run`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from shoal.launch.run import RunResult
from shoal.messages import Event, EventKind, Metric
from shoal.redact import without_credentials


def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:,.0f}"


class TerminalProgress:
    """A live bar (step/total, loss, samples/s, ETA) and one line per notable event."""

    def __init__(self, console: Console):
        self.console = console
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[speed]}"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            refresh_per_second=1,  # reports come every few seconds; rich's 10/s would take CPU from training
        )
        self.task = self.progress.add_task("starting", total=None, loss="-", speed="")

    def __enter__(self) -> TerminalProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def on_progress(self, step: int, total: int, metrics: dict[str, float]) -> None:
        loss = _fmt(metrics[Metric.TRAIN_LOSS]) if Metric.TRAIN_LOSS in metrics else "-"
        speed = ""
        if Metric.TRAIN_SAMPLES_PER_S in metrics:
            speed = f"{_fmt(metrics[Metric.TRAIN_SAMPLES_PER_S])} samples/s"
        if Metric.VAL_ACCURACY in metrics:
            speed += f"  val acc {metrics[Metric.VAL_ACCURACY]:.3f}"
        elif Metric.VAL_LOSS in metrics:
            speed += f"  val loss {_fmt(metrics[Metric.VAL_LOSS])}"
        self.progress.update(
            self.task,
            description="training",
            completed=step,
            total=total or None,
            loss=loss,
            speed=speed,
        )

    def on_checkpoint(self, path: str, step: int) -> None:
        pass  # the summary at the end names the latest checkpoint

    def on_event(self, event: Event) -> None:
        line = EVENT_LINES.get(event.kind)
        if line is not None:
            self.console.print(line(event.fields))


def _attempt_line(fields: dict[str, Any]) -> str:
    restored = fields.get("restored_step")
    where = f"resuming from step {restored}" if restored is not None else "from scratch"
    parallel = fields.get("parallel") or {}
    chosen = (  # what `auto` became is said; a precision the user named is not repeated
        f"; precision auto: {parallel.get('precision')} on {parallel.get('hardware')}"
        if parallel.get("precision_asked") == "auto"
        else ""
    )
    return (
        f"[cyan]attempt[/] on {fields['world_size']} worker(s) ({fields['device']}), {where}; "
        f"{fields['parameters']:,} parameters, accumulation {fields['accumulation']}{escape(chosen)}"
    )


def _failure_line(fields: dict[str, Any]) -> str:
    ranks = ", ".join(f"rank {r}: {escape(e.splitlines()[0][:160])}" for r, e in fields["errors"].items())
    return f"[yellow]worker failure[/] {ranks}; Ray Train restarts from the latest checkpoint"


def _on_node(fields: dict[str, Any]) -> str:
    return f" on {fields['node']}" if fields.get("node") else ""


def _straggler_line(fields: dict[str, Any]) -> str:
    who, median, steps = (
        f"worker rank {fields['rank']}{_on_node(fields)}",
        fields["median_s"],
        fields["steps"],
    )
    if fields.get("cause") == "link":
        what = f"its link to the head takes {fields['link_rtt_s'] * 1e3:.3g} ms a round trip"
        return (
            f"[yellow]straggler[/] {who}: {what} vs the others' median {median * 1e3:.3g} ms "
            f"for {steps} steps (to step {fields['step']}); the collectives wait for it"
        )
    return (
        f"[yellow]straggler[/] {who} took {fields['busy_s']:.3g} s of its own per step "
        f"vs the others' median {median:.3g} s for {steps} steps (to step {fields['step']})"
    )


# One terminal line per notable event kind (from the event's fields); the others
# (evaluations...) show in the bar.
EVENT_LINES: dict[EventKind, Callable[[dict[str, Any]], str]] = {
    EventKind.ATTEMPT_STARTED: _attempt_line,
    EventKind.FAILURE: _failure_line,
    EventKind.FATAL: lambda e: f"[red]fatal[/] {escape(e['reason'])}",
    EventKind.STRAGGLER: _straggler_line,
    EventKind.STRAGGLER_RECOVERED: lambda e: (
        f"[green]recovered[/] worker rank {e['rank']}{_on_node(e)} (step {e['step']})"
    ),
    EventKind.CHECKPOINT_SKIPPED: lambda e: (
        f"[yellow]checkpoint skipped[/] at step {e['step']}: the one of step {e['writing_step']} "
        "is still being written (checkpoint.if_busy: skip)"
    ),
    EventKind.PROFILE: lambda e: (
        f"[cyan]profile[/] rank {e['rank']} steps {e['first_step']}-{e['last_step']}: "
        f"MLflow artifact profiles/{e['name']}"
    ),
}


def browse_command(uri: str) -> str:
    uri = without_credentials(uri)  # a browser or `shoal runs` asks for them, or has them
    if uri.startswith(("http://", "https://")):
        return f"open {uri} (or: shoal runs list --tracking-uri {uri})"
    cwd_db = "sqlite:///" + str(Path("mlflow.db").resolve())
    shown = "sqlite:///mlflow.db" if uri == cwd_db else uri
    return f"mlflow ui --backend-store-uri {shown}"


def summary_table(result: RunResult) -> Table:
    colour = {"FINISHED": "green", "FAILED": "red", "KILLED": "yellow"}[result.status]
    table = Table(title=f"shoal run {result.run_name}: [{colour}]{result.status}[/]", show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # paths and commands are shown whole, never cut
    table.add_row("steps", f"{result.step} / {result.total_steps}")
    for key, value in sorted(result.metrics.items()):
        table.add_row(key, _fmt(value))
    if result.resumed_from is not None:
        table.add_row("resumed from step", str(result.resumed_from))
    table.add_row("restarts", str(result.restarts))
    if result.unsent_writes:
        table.add_row(
            "[red]MLflow[/]", f"{result.unsent_writes} writes could not be sent (store unreachable)"
        )
    if result.reason:
        table.add_row("reason", escape(result.reason))  # error text: "[...]" is not markup
    table.add_row("checkpoint", escape(result.checkpoint or "-"))
    if result.model_uri or result.model_error:
        table.add_row(
            "model", result.model_uri or f"[yellow]not logged[/]: {escape(result.model_error or '')}"
        )
    table.add_row("run directory", escape(result.run_dir))
    table.add_row("MLflow experiment", escape(result.experiment))
    table.add_row("MLflow run id", result.run_id)
    table.add_row("browse", escape(browse_command(result.tracking_uri)))
    return table
