"""What a run records about its own speed: step phases, per-worker times, FLOP/s, memory,
a straggler (a worker made slow for real), a profiler window, TensorBoard files, the
end-of-run plot, and browsing it all with `shoal runs`."""

from __future__ import annotations

import gzip
import io
import json
import statistics
from pathlib import Path

from mlflow.tracking import MlflowClient
from rich.console import Console

from shoal.cli import main
from shoal.launch import RunOptions, run
from shoal.launch.progress import TerminalProgress
from shoal.spec import load
from tests.conftest import write_workload

SLOW_MODEL = """
import time
import torch
import torch.distributed as dist

class SlowOnRankOne(torch.nn.Module):
    task = "classify"

    def __init__(self, delay: float = 0.08):
        super().__init__()
        self.delay = delay
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))

    def forward(self, x):
        if x.device.type != "meta" and dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(self.delay)  # a slow host: only this worker's forward pass takes longer
        return self.body(x)
"""
STEPS = 16


def artifact_paths(client: MlflowClient, run_id: str, path: str | None = None) -> list[str]:
    found = []
    for item in client.list_artifacts(run_id, path):
        found += artifact_paths(client, run_id, item.path) if item.is_dir else [item.path]
    return found


def test_a_run_records_its_speed_a_straggler_and_a_profile(workdir: Path, capsys) -> None:
    (workdir / "slow_model.py").write_text(SLOW_MODEL)
    data = {
        "name": "observed",
        "model": {"target": "slow_model:SlowOnRankOne"},
        "data": {"builtin": "digits", "batch_size": 16},
        "train": {"max_steps": STEPS, "eval_every": STEPS},
        "scaling": {"workers": 2},
        "monitor": {
            "stragglers": {"factor": 2.0, "steps": 3, "min_gap_s": 0.03},
            "profile": {"start_step": 3, "steps": 2},
            "tensorboard": True,
        },
    }
    terminal = Console(file=io.StringIO(), width=200)
    with TerminalProgress(terminal) as progress:
        loaded = load(write_workload(workdir, data), [], prepare_data=True)
        result = run(loaded, RunOptions(run_name="observed", report_interval_s=1.0), progress)
    assert result.ok, result.reason
    assert result.restarts == 0  # every rank takes the same report decisions (no barrier deadlock)
    client = MlflowClient(result.tracking_uri)

    def history(key: str) -> list[float]:
        points = sorted(client.get_metric_history(result.run_id, key), key=lambda m: m.step)
        assert [m.step for m in points] == list(range(1, STEPS + 1)), key
        return [m.value for m in points]

    step_s, forward_backward = history("time/step_s"), history("time/forward_backward_s")
    assert all(0 < fb <= total for fb, total in zip(forward_backward, step_s, strict=True))
    for key in ("time/data_wait_s", "time/optimizer_s"):
        assert min(history(key)) >= 0
    # A stall is a point at the step after it, only there: the reports the straggler's event
    # and the profile's trace set off (a barrier each) are some, not every step.
    reports = client.get_metric_history(result.run_id, "time/report_s")
    assert 0 < len(reports) < STEPS and all(m.value > 0 and 1 < m.step <= STEPS for m in reports)
    assert min(history("perf/tflops")) > 0 and min(history("memory/peak_mb")) > 100  # a process RSS
    samples = history("train/samples_per_s")
    per_worker = history("train/samples_per_s_per_worker")
    assert per_worker == [s / 2 for s in samples]
    slow, fast = history("worker/1/busy_s"), history("worker/0/busy_s")
    assert statistics.median(slow) >= 0.08 > statistics.median(fast)
    assert not client.get_metric_history(result.run_id, "perf/mfu")  # no GPU, no MFU

    events = json.loads(
        Path(client.download_artifacts(result.run_id, "events.json", str(workdir))).read_text()
    )
    stragglers = [e for e in events if e["kind"] == "straggler"]
    assert stragglers and {e["rank"] for e in stragglers} == {1}
    assert stragglers[0]["step"] <= 6 and stragglers[0]["ratio"] >= 2.0  # 3 slow steps in a row
    assert "straggler worker rank 1" in terminal.file.getvalue()  # the terminal's warning line

    artifacts = artifact_paths(client, result.run_id)
    for rank in (0, 1):
        name = f"rank{rank}.steps3-4.pt.trace.json.gz"
        assert f"profiles/{name}" in artifacts and f"tensorboard/profile/{name}" in artifacts
    trace = Path(
        client.download_artifacts(result.run_id, "profiles/rank1.steps3-4.pt.trace.json.gz", str(workdir))
    )
    events_in_trace = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert {"ProfilerStep#3", "ProfilerStep#4"} <= {e.get("name") for e in events_in_trace}
    assert any(path.startswith("tensorboard/events.out.tfevents") for path in artifacts)
    assert "plots/training.png" in artifacts

    assert main(["runs", "list", "--experiment", "observed"]) == 0
    assert result.run_id in capsys.readouterr().out
    assert main(["runs", "show", "observed"]) == 0
    shown = capsys.readouterr().out
    assert (
        "straggler" in shown and "attempt_started" in shown and "checkpoint-" not in shown.split("params")[1]
    )
    assert main(["runs", "compare", result.run_id, "observed"]) == 0
    assert "time/step_s" in capsys.readouterr().out
