"""What a person sees during and after `shoal sweep`: a live table of trials."""

from __future__ import annotations

from typing import Any

from ray.tune import Callback
from rich.console import Console
from rich.live import Live
from rich.table import Table

from shoal.launch.tuning import SweepResult
from shoal.output import Col, FittedTable, Fold


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class TrialEvents(Callback):
    """Tune's trial events, passed on to the table on screen.

    Tune pickles its callbacks into the experiment state and a resumed sweep gets
    the pickled copy back, so this one holds nothing: it finds the table of the
    process it runs in.
    """

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if _screen:
            _screen.update(trial, "RUNNING")

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        if _screen:
            _screen.update(trial, "RUNNING", result)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if _screen:
            _screen.complete(trial)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if _screen:
            _screen.update(trial, "ERROR")


class SweepTable:
    """A rich table of trials, kept current while the sweep runs (on the sweep's driver)."""

    def __init__(self, console: Console, paths: list[str], metric: str, mode: str):
        self.console, self.paths, self.metric, self.mode = console, paths, metric, mode
        self.rows: dict[str, dict[str, Any]] = {}
        self.live = Live(self._table(), console=console, auto_refresh=False, transient=False)

    def __enter__(self) -> SweepTable:
        global _screen
        self.live.start()
        _screen = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _screen
        _screen = None
        self.live.stop()

    def _row(self, trial: Any) -> dict[str, Any]:
        row = self.rows.setdefault(trial.trial_id, {"status": "PENDING", "step": 0, "metric": None})
        row["params"] = {p: trial.config.get(p) for p in self.paths}
        return row

    def update(self, trial: Any, status: str, result: dict[str, Any] | None = None) -> None:
        row = self._row(trial)
        row["status"] = status
        if result:
            row["step"] = int(result.get("step", row["step"]))
            row["total"] = int(result.get("total_steps") or 0)
            if self.metric in result:
                row["metric"] = result[self.metric]
        self.live.update(self._table(), refresh=True)

    def complete(self, trial: Any) -> None:
        result = trial.last_result or {}
        done = result.get("total_steps") and result.get("step", 0) >= result["total_steps"]
        self.update(trial, "FINISHED" if done else "STOPPED", result)

    def _table(self) -> FittedTable:
        columns = [
            Col("trial", priority=1, min_width=11),
            *[Col(path, fold=Fold.FREELY, min_width=8) for path in self.paths],
            Col("status", fold=Fold.NEVER, justify="right"),
            Col("step", fold=Fold.NEVER, justify="right"),
            Col(self.metric, fold=Fold.FREELY, min_width=8, justify="right"),
        ]
        rows = []
        scored = [r["metric"] for r in self.rows.values() if r["metric"] is not None]
        best = (min if self.mode == "min" else max)(scored) if scored else None
        colours = {"FINISHED": "green", "STOPPED": "yellow", "ERROR": "red", "RUNNING": "cyan"}
        for trial_id, row in self.rows.items():
            status = f"[{colours.get(row['status'], 'white')}]{row['status']}[/]"
            metric = _fmt(row["metric"]) if row["metric"] is not None else "-"
            if row["metric"] is not None and row["metric"] == best:
                metric = f"[bold]{metric} *[/]"
            params = [_fmt(row.get("params", {}).get(p)) for p in self.paths]
            rows.append([trial_id, *params, status, str(row["step"]), metric])
        return FittedTable(columns, rows, f"sweep: {self.metric} ({self.mode})")


_screen: SweepTable | None = None


def summary(result: SweepResult) -> Table:
    table = Table(title=f"shoal sweep {result.name}", show_header=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    counts: dict[str, int] = {}
    for trial in result.trials:
        counts[trial.status] = counts.get(trial.status, 0) + 1
    table.add_row("trials", ", ".join(f"{n} {s.lower()}" for s, n in sorted(counts.items())))
    if result.best:
        table.add_row(f"best {result.metric}", f"{result.best.metric:.6g} (trial {result.best.trial_id})")
        for path, value in result.best.params.items():
            table.add_row(f"  {path}", _fmt(value))
        table.add_row("best workload", result.best_file or "-")
    if result.placement_groups_left:
        held = (
            f"[yellow]{result.placement_groups_left} placement group(s) made by the sweep still reserved[/]"
        )
        table.add_row("resources", held)
    table.add_row("sweep directory", result.directory)
    table.add_row("MLflow experiment", result.experiment)
    table.add_row("MLflow parent run", result.parent_run_id)
    return table
