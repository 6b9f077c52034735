"""ASHA whose rungs survive `shoal sweep --resume`.

Ray Tune saves no scheduler state with an experiment: `Tuner.restore` rebuilds the
scheduler from the copy pickled when the sweep started (ray-project/ray#30838, open),
so every score recorded at a rung is lost, and a resumed sweep judges its trials
against nothing: a hopeless trial that reaches a rung first goes on to the end.
This scheduler writes its rungs to the sweep's folder after every decision and reads
them back when Tune unpickles it on restore.

Imported only where a sweep runs: it imports Ray Tune (see launch/tuning.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ray.tune.schedulers import ASHAScheduler


class ResumableASHA(ASHAScheduler):
    def __init__(self, *, state_file: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.state_file = state_file
        Path(state_file).unlink(missing_ok=True)  # a new sweep starts from empty rungs

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict) -> str:
        action = super().on_trial_result(tune_controller, trial, result)
        self._save_rungs()
        return action

    def on_trial_complete(self, tune_controller: Any, trial: Any, result: dict) -> None:
        super().on_trial_complete(tune_controller, trial, result)
        self._save_rungs()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Tune unpickles the scheduler as it was when the sweep started: add what it recorded since."""
        self.__dict__.update(state)
        self._load_rungs()

    def _save_rungs(self) -> None:
        rungs = [[[milestone, _scores(recorded)] for milestone, recorded in b._rungs] for b in self._brackets]
        path = Path(self.state_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        partial.write_text(json.dumps({"rungs": rungs, "stopped": self._num_stopped}))
        os.replace(partial, path)  # a kill mid-write leaves the previous whole file

    def _load_rungs(self) -> None:
        path = Path(self.state_file)
        if not path.exists():
            return
        saved = json.loads(path.read_text())
        for bracket, rungs in zip(self._brackets, saved["rungs"], strict=True):  # one sweep, one layout
            for (milestone, recorded), (saved_milestone, scores) in zip(bracket._rungs, rungs, strict=True):
                assert milestone == saved_milestone, (milestone, saved_milestone)
                recorded.update(scores)
        self._num_stopped = max(self._num_stopped, saved["stopped"])


def _scores(recorded: dict[str, Any]) -> dict[str, float]:
    return {trial: float(score) for trial, score in recorded.items()}  # Tune's are numpy floats
