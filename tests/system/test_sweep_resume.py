"""`shoal sweep`: an ASHA sweep whose driver is SIGKILLed mid-sweep and resumed with
`--resume`; nested MLflow runs, early-stopped trials, the best workload, resources given back.

The sweep starts a local Ray of its own (with the dashboard, which Ray Train's
placement-group cleaner needs), as `shoal sweep` does without --address.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

from shoal.launch.sweep import is_whole_state
from shoal.launch.tuning import ASHA_RUNGS
from tests.conftest import write_workload
from tests.integration.helpers import loss_steps, shoal_cli, wait_for


def mlflow(workdir: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")


def finish(process: subprocess.Popen, timeout_s: float = 400) -> tuple[int, str]:
    out, err = process.communicate(timeout=timeout_s)
    return process.returncode, out + err


SWEEP = {
    "name": "tiny",
    "model": {"family": "mlp", "args": {"hidden": 32}},
    "data": {"builtin": "digits", "batch_size": 32},
    "train": {"max_steps": 20, "eval_every": 5, "optimizer": {"lr": 0.01}},
    "scaling": {"workers": 1, "threads_per_worker": 1},
    "checkpoint": {"every_steps": 5},
    "sweep": {
        "metric": "val/accuracy",
        "mode": "max",
        "samples": 2,
        "max_concurrent": 2,
        "scheduler": "asha",
        "grace_period": 5,
        "space": {
            # A good and a hopeless learning rate, twice: ASHA stops a hopeless one.
            "train.optimizer.lr": {"grid": [0.03, 1.0e-6]},
            "model.args.hidden": {"choice": [16, 32]},
        },
    },
}


def trial_results(sweep_dir: Path) -> int:
    return sum(1 for p in sweep_dir.glob("*/result.json") if p.stat().st_size > 0)


def state_is_whole(sweep_dir: Path) -> bool:
    """Ray Tune's newest experiment state in the sweep's folder reads back. Tune copies it there
    in place, so a kill during the copy leaves it cut short: that sweep cannot be resumed, and
    `shoal sweep --resume` says so (tests/unit/test_sweep.py). This test kills between copies."""
    states = sorted(sweep_dir.glob("experiment_state-*.json"))
    return bool(states) and is_whole_state(states[-1])


def test_asha_sweep_nests_runs_frees_resources_and_resumes(workdir: Path) -> None:
    write_workload(workdir, SWEEP)
    args = ["sweep", "w.yaml", "--name", "s1"]  # a local Ray of its own, with the dashboard
    first = shoal_cli(args, workdir)
    sweep_dir = workdir / "shoal_runs" / "sweeps" / "s1"
    wait_for(
        lambda: (trial_results(sweep_dir) >= 1 and state_is_whole(sweep_dir)) or first.poll() is not None,
        240,
        "a first trial result",
    )
    assert first.poll() is None, first.communicate()
    os.kill(first.pid, signal.SIGKILL)  # the sweep's driver dies mid-sweep
    first.wait()

    code, output = finish(shoal_cli([*args, "--resume"], workdir))
    assert code == 0, output
    client = mlflow(workdir)
    experiment = client.get_experiment_by_name("tiny").experiment_id
    parents = client.search_runs([experiment], "tags.`shoal.role` = 'sweep'")
    assert [p.info.status for p in parents] == ["FINISHED"]
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert len({c.data.tags["shoal.trial_id"] for c in children}) == len(children) == 4
    stopped = [c for c in children if c.data.tags.get("shoal.early_stopped") == "true"]
    finished = [c for c in children if c.info.status == "FINISHED"]
    assert stopped and all(c.info.status == "KILLED" for c in stopped), [c.info for c in children]
    assert len(stopped) + len(finished) == 4
    for child in stopped:
        assert max(loss_steps(client, child.info.run_id)) < 20
    for child in finished:
        assert loss_steps(client, child.info.run_id) == list(range(1, 21))

    # ASHA kept every trial's scores across the kill (Tune alone forgets them: launch/asha.py).
    rungs = json.loads((sweep_dir / ASHA_RUNGS).read_text())["rungs"]
    recorded = {trial for bracket in rungs for _, scores in bracket for trial in scores}
    assert recorded == {c.data.tags["shoal.trial_id"] for c in children}, rungs

    # Trials with the same values train identically (same seed), so the best may be a tie.
    top = max(c.data.metrics["val/accuracy"] for c in finished)
    tags = parents[0].data.tags
    (winner,) = [c for c in finished if c.data.tags["shoal.trial_id"] == tags["shoal.best.trial"]]
    assert winner.data.metrics["val/accuracy"] == top and "best configuration" in output
    best = yaml.safe_load((sweep_dir / "best.yaml").read_text())
    assert best["train"]["optimizer"]["lr"] == float(winner.data.params["train.optimizer.lr"])
    assert best["model"]["args"]["hidden"] == int(winner.data.params["model.args.hidden"])
    assert "sweep" not in best
    code, checked = finish(shoal_cli(["validate", str(sweep_dir / "best.yaml")], workdir))
    assert code == 0, checked
    # Stopped trials gave their workers' placement groups back (the sweep counts those left).
    assert tags["shoal.placement_groups_left"] == "0"
