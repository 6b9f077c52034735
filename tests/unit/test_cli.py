"""The `shoal` command on bad input: one clear line, exit 2, never a traceback.

These run the real console script in a subprocess, as a user would.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import WORKLOADS, quickstart, write_workload

SHOAL = [sys.executable, "-m", "shoal.cli"]


def shoal(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*SHOAL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_validate_ok(tmp_path: Path) -> None:
    result = shoal("validate", str(WORKLOADS / "quickstart.yaml"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "ok" in result.stdout and "quickstart" in result.stdout


def test_malformed_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\nmodel: [unclosed\n")
    assert_user_error(shoal("validate", str(path), cwd=tmp_path), f"{path}:", "malformed YAML")


def test_unknown_key(tmp_path: Path) -> None:
    data = quickstart()
    data["train"]["lr"] = 0.1
    path = write_workload(tmp_path, data)
    assert_user_error(shoal("run", str(path), cwd=tmp_path), "train.lr: unknown key 'lr'")


def test_wrong_type(tmp_path: Path) -> None:
    result = shoal("run", str(WORKLOADS / "quickstart.yaml"), "--set", "train.max_steps=lots", cwd=tmp_path)
    assert_user_error(result, "--set train.max_steps=lots", "must be an integer (got 'lots')")


def test_missing_data_directory(tmp_path: Path) -> None:
    data = quickstart()
    data["data"] = {"train": {"path": "data/train"}, "batch_size": 64}
    path = write_workload(tmp_path, data)
    result = shoal("run", str(path), cwd=tmp_path)
    assert_user_error(result, "data.train.path: no such file or directory: 'data/train'")
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "shoal_runs").exists()


def test_unreachable_address(tmp_path: Path) -> None:
    result = shoal("run", str(WORKLOADS / "quickstart.yaml"), "--address", "127.0.0.1:1", cwd=tmp_path)
    assert_user_error(result, "no Ray cluster at --address '127.0.0.1:1'")
    assert not (tmp_path / "mlflow.db").exists()


def test_address_that_is_not_host_port(tmp_path: Path) -> None:
    result = shoal("run", str(WORKLOADS / "quickstart.yaml"), "--address", "my-cluster", cwd=tmp_path)
    assert_user_error(result, "is not HOST:PORT")


@pytest.mark.parametrize("name", ["imagenet"])
def test_data_prepare_unknown(tmp_path: Path, name: str) -> None:
    assert_user_error(shoal("data", "prepare", name, str(tmp_path / "x"), cwd=tmp_path), "unknown corpus")


def test_data_prepare_digits(tmp_path: Path) -> None:
    result = shoal("data", "prepare", "digits", str(tmp_path / "digits"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "digits" / "manifest.json").exists()


def test_sweep_needs_a_sweep_section(tmp_path: Path) -> None:
    result = shoal("sweep", str(WORKLOADS / "quickstart.yaml"), cwd=tmp_path)
    assert_user_error(result, "quickstart.yaml: no 'sweep' section")


def test_sweep_resume_without_a_sweep(tmp_path: Path) -> None:
    data = quickstart()
    data["sweep"] = {"space": {"train.seed": {"choice": [0, 1]}}}
    result = shoal("sweep", str(write_workload(tmp_path, data)), "--resume", cwd=tmp_path)
    assert_user_error(result, "--resume: no sweep of 'quickstart' to resume in")


def test_submit_needs_the_workload_inside_the_working_dir(tmp_path: Path) -> None:
    result = shoal(
        "submit", str(WORKLOADS / "quickstart.yaml"), "--address", "http://127.0.0.1:1", cwd=tmp_path
    )
    assert_user_error(result, "is not inside --working-dir", "only that directory travels to the cluster")


def test_submit_to_no_cluster(tmp_path: Path) -> None:
    write_workload(tmp_path, quickstart())
    result = shoal("submit", "w.yaml", "--address", "http://127.0.0.1:1", cwd=tmp_path)
    assert_user_error(result, "no Ray dashboard at --address http://127.0.0.1:1")


def test_jobs_need_a_job_id(tmp_path: Path) -> None:
    assert_user_error(shoal("jobs", "stop", cwd=tmp_path), "shoal jobs stop needs a JOB id")
