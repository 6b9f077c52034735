"""A `sweep` section in Ray Tune's terms: search space, searcher, scheduler; and one trial.

A trial is an ordinary shoal job (`launch.run`) on the trial's own thread pair:
the job runs on a helper thread while the trial thread passes its evaluations to
Tune, which decides (ASHA, PBT) whether the trial goes on.

Ray Tune is imported inside the functions that use it: it takes most of a second
to import, and the CLI imports this module for commands that run no sweep.
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ShoalError
from shoal.launch.run import RunOptions, run
from shoal.messages import Event, EventKind, Metric, eval_metrics
from shoal.spec import load
from shoal.spec.schema import SearchDomain, SweepSpec, Workload
from shoal.spec.sweep import with_values
from shoal.tracking.sweep_runs import TRIAL_TAG, trial_run

# In the sweep's folder: what ASHA recorded, for --resume. Not named *.json or *.pkl: Tune copies
# those from the sweep's folder into its staging folder on restore and back again on every sync
# (tune/execution/experiment_state.py), which would put the copy from the start of a resume back.
ASHA_RUNGS = "asha_rungs.state"
POINTER = "shoal-checkpoint.json"  # a Tune checkpoint of a trial: which shoal checkpoint it means


class SweepError(ShoalError, RuntimeError):
    """A sweep that cannot start (missing optional package, nothing to resume)."""


@dataclass
class TrialOutcome:
    trial_id: str
    params: dict[str, Any]
    status: str  # FINISHED | STOPPED (early, by the scheduler) | ERROR | PENDING
    step: int
    metric: float | None
    run_id: str | None


@dataclass
class SweepResult:
    name: str
    directory: str
    parent_run_id: str
    experiment: str
    tracking_uri: str
    metric: str
    mode: str
    trials: list[TrialOutcome] = field(default_factory=list)
    best: TrialOutcome | None = None
    best_file: str | None = None
    best_yaml: str | None = None
    placement_groups_left: int = 0  # created during the sweep and still reserved at its end
    model_uri: str | None = None  # the best trial's model, registered (tracking.register)

    @property
    def ok(self) -> bool:
        return self.best is not None and not any(t.status == "ERROR" for t in self.trials)


def tune_domain(domain: SearchDomain, as_grid: bool = False) -> Any:
    from ray import tune  # lazy: see the module docstring

    low_high = domain.values
    if domain.kind == "grid" or (as_grid and domain.kind == "choice"):
        return tune.grid_search(domain.values)
    if domain.kind == "choice":
        return tune.choice(domain.values)
    if domain.kind == "uniform":
        return tune.uniform(*low_high)
    if domain.kind == "loguniform":
        return tune.loguniform(*low_high)
    return tune.randint(low_high[0], low_high[1] + 1)  # Tune's upper bound is exclusive


def search_space(sweep: SweepSpec) -> dict[str, Any]:
    return {path: tune_domain(d, sweep.searcher == "grid") for path, d in sweep.space.items()}


def make_searcher(sweep: SweepSpec) -> Any:
    if sweep.searcher != "optuna":
        return None  # Tune's own variant generator: random sampling, grids crossed
    try:  # optional packages, imported only for an optuna sweep
        import optuna  # noqa: F401  (OptunaSearch imports it only when built)
        from ray.tune.search.optuna import OptunaSearch
    except ImportError:
        raise SweepError(
            "sweep.searcher: optuna needs the optuna package; install it with "
            "`pip install 'shoal[optuna]'` (or `pip install optuna`), or use searcher: random"
        ) from None
    return OptunaSearch(seed=0)


def make_scheduler(sweep: SweepSpec, workload: Workload, state_dir: Path) -> Any:
    """Tune's scheduler for the sweep; ASHA keeps its rungs in `state_dir` for --resume."""
    from ray.tune.schedulers import FIFOScheduler, PopulationBasedTraining  # lazy

    from shoal.launch.asha import ResumableASHA  # lazy: imports Ray Tune

    max_steps = workload.train.max_steps or 1
    if sweep.scheduler == "asha":
        grace = sweep.grace_period or max(1, max_steps // 8)
        return ResumableASHA(
            state_file=str(state_dir.resolve() / ASHA_RUNGS),
            time_attr="step",
            max_t=max_steps,
            grace_period=min(grace, max_steps),
            reduction_factor=sweep.reduction_factor,
        )
    if sweep.scheduler == "pbt":
        interval = sweep.perturbation_interval or workload.checkpoint.every_steps
        mutations = {path: tune_domain(d) for path, d in sweep.space.items()}
        return PopulationBasedTraining(
            time_attr="step", perturbation_interval=interval, hyperparam_mutations=mutations
        )
    return FIFOScheduler()


class TrialObserver:
    """Collects what Tune needs from a trial's job: the metric at each evaluation, and
    (for PBT) each new checkpoint. Called on the job's drainer thread."""

    def __init__(self, metric: str, sink: queue.Queue, checkpoints: bool, total: int):
        self.metric, self.sink, self.checkpoints = metric, sink, checkpoints
        self.latest: dict[str, float] = {}
        self.evals: dict[str, float] = {}
        # Known before the first report: a resumed job replays its last evaluation before that.
        self.step, self.total = 0, total

    def on_progress(self, step: int, total: int, metrics: dict[str, float]) -> None:
        self.step, self.total, self.latest = step, total or self.total, dict(metrics)
        if self.metric == Metric.TRAIN_LOSS and Metric.TRAIN_LOSS in metrics and step:
            self.sink.put(({"step": step, **self.latest}, None))

    def on_event(self, event: Event) -> None:
        if event.kind == EventKind.EVAL and self.metric in event.fields:
            self.evals = eval_metrics(event.fields)
            if not self.checkpoints:  # with checkpoints, results go with them (the same step's eval)
                self.sink.put(({**self.latest, **self.evals, "step": event.fields["step"]}, None))

    def on_checkpoint(self, path: str, step: int) -> None:
        if self.checkpoints:
            metrics = {**self.latest, **self.evals, "step": step}
            self.sink.put((metrics, {"checkpoint": path, "step": step}))


def _donor(trial_id: str) -> dict[str, Any] | None:
    """The shoal checkpoint Tune restarts this trial from (its own, or another's under PBT)."""
    from ray import tune  # lazy: see the module docstring

    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return json.loads((Path(directory) / POINTER).read_text())


def _tune_checkpoint(pointer: dict[str, Any]) -> Any:
    from ray import tune  # lazy: see the module docstring

    directory = tempfile.mkdtemp(prefix="shoal-trial-")
    (Path(directory) / POINTER).write_text(json.dumps(pointer))
    return tune.Checkpoint.from_directory(directory)


def run_trial(config: dict[str, Any], *, context: dict[str, Any]) -> None:
    """One trial: the base workload with this trial's values, trained as a shoal job."""
    from ray import tune  # lazy: see the module docstring

    if os.path.isdir(context["cwd"]):
        os.chdir(context["cwd"])  # relative paths in the workload mean what they meant to the sweep
    trial_id = tune.get_context().get_trial_id()
    values = {path: config[path] for path in context["paths"]}
    run_name, init_from = f"{context['sweep']}-{trial_id}", None
    donor = _donor(trial_id)
    if donor and donor["trial_id"] != trial_id:  # PBT: continue from a better trial's weights
        run_name = f"{run_name}-from-{donor['trial_id']}-{donor['step']}"
        init_from = donor["checkpoint"]
    elif donor:
        run_name = donor["run_name"]
    with tempfile.TemporaryDirectory(prefix="shoal-trial-") as tmp:
        spec_file = Path(tmp) / f"{run_name}.yaml"
        spec_file.write_text(json.dumps(with_values(context["base"], values)))
        loaded = load(spec_file, prepare_data=True)
    run_id = trial_run(context["uri"], context["experiment"], context["parent"], trial_id, run_name)
    tags = {"shoal.sweep": context["sweep"], TRIAL_TAG: trial_id, "mlflow.parentRunId": context["parent"]}
    options = RunOptions(run_name=run_name, tags=tags, mlflow_run_id=run_id, init_from=init_from)
    total = loaded.workload.train.max_steps or 0
    observer = TrialObserver(context["metric"], queue.Queue(), checkpoints=context["pbt"], total=total)
    _train_and_report(loaded, options, observer, trial_id, run_id)


def _train_and_report(loaded: Any, options: Any, observer: TrialObserver, trial_id: str, run_id: str) -> None:
    """Pass the job's results to Tune as they come. The last one waits until the job has ended:
    Tune ends a trial as soon as it reaches the scheduler's last step, and the job must have
    recorded its end in MLflow by then."""
    from ray import tune  # lazy: see the module docstring

    outcome: dict[str, Any] = {}

    def job() -> None:
        try:
            outcome["result"] = run(loaded, options, observer)
        except BaseException as exc:  # handed to the trial thread
            outcome["error"] = exc

    worker = threading.Thread(target=job, name="shoal-trial-job", daemon=True)
    worker.start()
    identity = {"mlflow_run_id": run_id, "run_name": options.run_name, "trial_id": trial_id}
    last: tuple[dict[str, Any], Any] | None = None
    while worker.is_alive() or not observer.sink.empty():
        try:
            metrics, saved = observer.sink.get(timeout=0.5)
        except queue.Empty:
            continue
        checkpoint = None
        if saved is not None:  # PBT: a new checkpoint, offered with its step's metrics
            if observer.metric not in metrics:
                continue
            checkpoint = _tune_checkpoint({**saved, "trial_id": trial_id, "run_name": options.run_name})
        result = ({**metrics, **identity, "total_steps": observer.total}, checkpoint)
        if observer.total and metrics["step"] >= observer.total:
            last = result
        else:
            tune.report(result[0], checkpoint=result[1])
    if "error" in outcome:
        raise outcome["error"]
    if not outcome["result"].ok:
        raise RuntimeError(f"trial {options.run_name} {outcome['result'].status}: {outcome['result'].reason}")
    if last is not None:
        tune.report(last[0], checkpoint=last[1])
