"""The `sweep` section: validation of the search space, and its translation into Ray Tune."""

from __future__ import annotations

import queue
import sys
from pathlib import Path

import pytest

from shoal.launch.tuning import SweepError, TrialObserver, make_scheduler, make_searcher, search_space
from shoal.messages import Event, EventKind
from shoal.spec import SpecError, load
from shoal.spec.sweep import with_values
from tests.conftest import quickstart, write_workload


def sweep_workload(tmp_path: Path, **sweep) -> Path:
    data = quickstart()
    data["sweep"] = {
        "metric": "val/accuracy",
        "mode": "max",
        "space": {"train.optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
    }
    data["sweep"].update(sweep)
    return write_workload(tmp_path, data)


def errors_of(path: Path) -> list[str]:
    with pytest.raises(SpecError) as caught:
        load(path)
    return [str(issue) for issue in caught.value.issues]


def test_a_sweep_section_validates(tmp_path: Path) -> None:
    space = {
        "train.optimizer.lr": {"loguniform": [1e-4, 1e-2]},
        "model.args.channels": {"choice": [16, 32]},
        "train.seed": {"grid": [0, 1]},
        "train.optimizer.weight_decay": {"uniform": [0.0, 0.1]},
        "train.schedule.warmup_steps": {"randint": [0, 20]},
    }
    loaded = load(sweep_workload(tmp_path, space=space, samples=4, scheduler="asha"))
    assert loaded.workload.sweep.samples == 4 and list(loaded.workload.sweep.space) == list(space)


@pytest.mark.parametrize(
    "sweep,expected",
    [
        (
            {"space": {"train.bogus": {"choice": [1]}}},
            "sweep.space.train.bogus: 'train.bogus' is not a setting",
        ),
        ({"space": {"tracking.uri": {"choice": ["x"]}}}, "'tracking.uri' cannot be searched"),
        (
            {"space": {"train.optimizer.momentum": {"uniform": [0.5, 1.0]}}},
            "uniform value 1.0 for train.optimizer.momentum: must be < 1 (got 1.0)",
        ),
        (
            {"space": {"data.batch_size": {"choice": [64, 48]}}},
            "choice value 48 for data.batch_size: 128 is not a multiple of data.batch_size (48)",
        ),
        ({"space": {"train.seed": {"uniform": [2, 1]}}}, "uniform: low (2.0) must be <= high (1.0)"),
        ({"space": {"train.seed": {"choice": [1], "grid": [2]}}}, "give exactly one of choice, grid"),
        ({"metric": "val/f1"}, "sweep.metric: 'val/f1' is not one of train/loss, val/loss, val/accuracy"),
        ({"searcher": "grid"}, "grid search needs listed values; train.optimizer.lr is loguniform"),
        (
            {"searcher": "optuna", "space": {"train.seed": {"grid": [0, 1]}}},
            "optuna samples its own values; make train.seed a choice, not a grid",
        ),
        ({"scheduler": "pbt", "space": {"train.seed": {"grid": [0, 1]}}}, "pbt samples its own values"),
    ],
)
def test_a_bad_sweep_is_refused_with_its_place(tmp_path: Path, sweep: dict, expected: str) -> None:
    path = sweep_workload(tmp_path, **sweep)
    found = errors_of(path)
    assert any(expected in e and e.startswith(f"{path}:") for e in found), found


def test_asha_needs_a_step_count(tmp_path: Path) -> None:
    data = quickstart()
    data["train"].pop("max_steps")
    data["train"]["epochs"] = 2
    data["sweep"] = {"space": {"train.seed": {"choice": [0, 1]}}}
    assert any("asha needs train.max_steps" in e for e in errors_of(write_workload(tmp_path, data)))


def test_pbt_needs_checkpoints(tmp_path: Path) -> None:
    data = quickstart()
    data["checkpoint"].pop("every_steps")
    data["sweep"] = {"scheduler": "pbt", "space": {"train.optimizer.lr": {"uniform": [0.001, 0.01]}}}
    assert any("pbt copies checkpoints" in e for e in errors_of(write_workload(tmp_path, data)))
    data["checkpoint"]["every_steps"] = 100
    data["sweep"]["metric"] = "val/loss"
    assert any(
        "max_concurrent (2) must be >= samples" in e for e in errors_of(write_workload(tmp_path, data))
    )
    data["train"]["eval_every"] = 30
    assert any(
        "eval_every divide checkpoint.every_steps" in e for e in errors_of(write_workload(tmp_path, data))
    )


def test_search_space_in_tune_terms(tmp_path: Path) -> None:
    from ray.tune.search.sample import Categorical, Float, Integer

    space = {
        "train.optimizer.lr": {"loguniform": [1e-4, 1e-2]},
        "train.seed": {"grid": [0, 1]},
        "model.args.channels": {"choice": [16, 32]},
        "train.schedule.warmup_steps": {"randint": [0, 20]},
    }
    sweep = load(sweep_workload(tmp_path, space=space)).workload.sweep
    tuned = search_space(sweep)
    assert isinstance(tuned["train.optimizer.lr"], Float) and tuned["train.optimizer.lr"].lower == 1e-4
    assert tuned["train.seed"] == {"grid_search": [0, 1]}
    assert isinstance(tuned["model.args.channels"], Categorical)
    warmup = tuned["train.schedule.warmup_steps"]
    assert isinstance(warmup, Integer) and (warmup.lower, warmup.upper) == (0, 21)  # 20 included
    sweep.searcher = "grid"
    assert search_space(sweep)["model.args.channels"] == {"grid_search": [16, 32]}


class Trial:
    def __init__(self, trial_id: str):
        self.trial_id = trial_id


def asha_decisions(scheduler, results: list[tuple[str, int, float]]) -> list[str]:
    decisions = []
    for trial_id, step, accuracy in results:
        trial = Trial(trial_id)
        if trial_id not in scheduler._trial_info:
            scheduler.on_trial_add(None, trial)
        decisions.append(scheduler.on_trial_result(None, trial, {"step": step, "val/accuracy": accuracy}))
    return decisions


def test_asha_judges_a_resumed_sweep_against_the_scores_recorded_before(tmp_path: Path) -> None:
    """Tune restores the scheduler pickled when the sweep started (ray-project/ray#30838):
    a plain ASHA forgets its rungs; shoal's reads them back from the sweep's folder."""
    import pickle

    from ray.tune.schedulers import ASHAScheduler

    w = load(sweep_workload(tmp_path, scheduler="asha", grace_period=5)).workload
    w.train.max_steps = 20
    asha = make_scheduler(w.sweep, w, tmp_path)
    plain = ASHAScheduler(time_attr="step", metric="val/accuracy", mode="max", max_t=20, grace_period=5)
    at_start = [pickle.dumps(s) for s in (asha, plain)]  # as Tune writes tuner.pkl
    before_the_kill = [("good", 5, 0.8), ("bad", 5, 0.1), ("good", 10, 0.9)]
    for scheduler in (asha, plain):
        scheduler.set_search_properties("val/accuracy", "max")
        assert asha_decisions(scheduler, before_the_kill) == ["CONTINUE", "STOP", "CONTINUE"]

    resumed, plain_resumed = (pickle.loads(p) for p in at_start)
    for scheduler in (resumed, plain_resumed):
        scheduler.set_search_properties("val/accuracy", "max")
    assert asha_decisions(resumed, [("hopeless", 5, 0.1)]) == ["STOP"]
    assert asha_decisions(plain_resumed, [("hopeless", 5, 0.1)]) == ["CONTINUE"]  # Ray's own: forgotten
    assert asha_decisions(resumed, [("good", 20, 0.95)]) == ["STOP"]  # the end of a trial, as before
    fresh = make_scheduler(w.sweep, w, tmp_path)  # a new sweep of that name starts from empty rungs
    fresh.set_search_properties("val/accuracy", "max")
    assert asha_decisions(fresh, [("hopeless", 5, 0.1)]) == ["CONTINUE"]


def test_schedulers_and_searchers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

    loaded = load(sweep_workload(tmp_path, grace_period=50, reduction_factor=3))
    w = loaded.workload
    asha = make_scheduler(w.sweep, w, tmp_path)
    assert isinstance(asha, ASHAScheduler)
    assert (asha._time_attr, asha._max_t, asha._reduction_factor) == ("step", 400, 3)
    assert asha._brackets[0]._rungs[-1][0] == 50  # the first rung is at the grace period
    w.sweep.scheduler = "fifo"
    assert isinstance(make_scheduler(w.sweep, w, tmp_path), FIFOScheduler)
    w.sweep.scheduler, w.sweep.perturbation_interval = "pbt", 100
    pbt = make_scheduler(w.sweep, w, tmp_path)
    assert isinstance(pbt, PopulationBasedTraining) and pbt._perturbation_interval == 100
    assert set(pbt._hyperparam_mutations) == {"train.optimizer.lr"}
    assert make_searcher(w.sweep) is None
    w.sweep.searcher = "optuna"
    assert type(make_searcher(w.sweep)).__name__ == "OptunaSearch"
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if not installed
    with pytest.raises(SweepError, match=r"pip install 'shoal\[optuna\]'"):
        make_searcher(w.sweep)


def test_with_values_sets_dotted_paths_and_drops_the_sweep() -> None:
    base = {"train": {"optimizer": {"lr": 1.0}}, "model": {"args": {}}, "sweep": {"samples": 2}}
    trial = with_values(base, {"train.optimizer.lr": 0.5, "model.args.hidden": 16})
    assert trial == {"train": {"optimizer": {"lr": 0.5}}, "model": {"args": {"hidden": 16}}}
    assert base["train"]["optimizer"]["lr"] == 1.0  # the base is left alone


def test_trial_observer_passes_evaluations_and_knows_the_last_step() -> None:
    sink: queue.Queue = queue.Queue()
    observer = TrialObserver("val/accuracy", sink, checkpoints=False, total=40)
    replayed = {"step": 40, "val/accuracy": 0.9, "val/loss": 0.3}
    observer.on_event(Event(EventKind.EVAL, 0, replayed))  # replayed first
    observer.on_progress(10, 40, {"train/loss": 1.5})  # no evaluation in it: nothing for Tune
    observer.on_checkpoint("/runs/x/checkpoint-00000010", 10)  # only PBT needs checkpoints
    observer.on_event(Event(EventKind.ATTEMPT_STARTED, 0))
    assert sink.get_nowait() == ({"step": 40, "val/accuracy": 0.9, "val/loss": 0.3}, None)
    assert sink.empty() and observer.total == 40
    pbt = TrialObserver("val/accuracy", sink, checkpoints=True, total=40)
    pbt.on_progress(10, 40, {"train/loss": 1.5})
    pbt.on_event(Event(EventKind.EVAL, 0, {"step": 20, "val/accuracy": 0.8}))  # reported with the checkpoint
    pbt.on_checkpoint("/runs/x/checkpoint-00000020", 20)
    saved = {"checkpoint": "/runs/x/checkpoint-00000020", "step": 20}
    assert sink.get_nowait() == ({"step": 20, "train/loss": 1.5, "val/accuracy": 0.8}, saved)
    assert sink.empty()


def test_a_cut_short_sweep_state_is_set_aside_for_the_newest_whole_one(tmp_path: Path) -> None:
    from shoal.launch.sweep import set_aside_torn_state

    whole = tmp_path / "experiment_state-2026-12-03_10-00-00.json"
    whole.write_text('{"trial_data": []}')
    torn = tmp_path / "experiment_state-2026-12-03_11-00-00.json"
    torn.write_text('{"trial_da')  # the copy was cut short by the driver's death
    set_aside_torn_state(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        whole.name,
        "experiment_state-2026-12-03_11-00-00.json.torn",
    ]


def test_a_sweep_with_no_whole_state_is_refused_with_the_reason(tmp_path: Path) -> None:
    from shoal.launch.sweep import set_aside_torn_state

    sweep_dir = tmp_path / "s1"
    sweep_dir.mkdir()
    (sweep_dir / "experiment_state-2026-12-03_11-00-00.json").write_text("")
    with pytest.raises(SweepError) as refused:
        set_aside_torn_state(sweep_dir)
    message = str(refused.value)
    assert "'s1'" in message and "experiment_state-2026-12-03_11-00-00.json cut short" in message
    assert "without --resume" in message
    assert not list(sweep_dir.glob("*.json"))
