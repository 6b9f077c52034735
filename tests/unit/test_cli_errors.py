"""ShoalError: one base for shoal's errors, and how the CLI shows one (no Ray)."""

from __future__ import annotations

import pickle

import pytest

from shoal import cli
from shoal.data import DataError
from shoal.degrees import DegreeError
from shoal.errors import EXIT_USAGE, ShoalError
from shoal.launch.cluster import ClusterError
from shoal.launch.jobs import JobError
from shoal.launch.storage import StorageError
from shoal.launch.tuning import SweepError
from shoal.models.registry import ModelError
from shoal.plan.planner import PlanError
from shoal.spec.loader import SpecError, SpecIssue
from shoal.tracking.mlflow_run import TrackingError
from shoal.worker.precision import PrecisionError

# Each error class with the extra base that existing `except` sites rely on.
ERRORS = {
    SpecError: Exception,
    PlanError: ValueError,
    DegreeError: ValueError,
    PrecisionError: RuntimeError,
    ModelError: ValueError,
    DataError: ValueError,
    TrackingError: RuntimeError,
    StorageError: Exception,
    ClusterError: RuntimeError,
    JobError: RuntimeError,
    SweepError: RuntimeError,
}


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: e.__name__)
def test_every_error_class_is_a_shoal_error_and_keeps_its_base(error: type) -> None:
    assert issubclass(error, ShoalError) and issubclass(error, ERRORS[error])
    assert error.exit_code == EXIT_USAGE


def test_a_shoal_error_is_one_line_with_its_where() -> None:
    error = ShoalError("must be a positive integer (got 0)", where="--gpus")
    assert str(error) == "must be a positive integer (got 0)"  # str() is the message alone
    assert error.lines() == ["--gpus: must be a positive integer (got 0)"]
    assert ShoalError("no such run").lines() == ["no such run"]


def test_data_error_names_its_setting() -> None:
    error = DataError("data.train.path", "no parquet files found at 'x'")
    assert error.where == error.path == "data.train.path"
    assert error.lines() == ["data.train.path: no parquet files found at 'x'"]


def test_spec_error_is_one_line_per_issue() -> None:
    issues = [SpecIssue("w.yaml:3", "train.lr", "unknown key 'lr'"), SpecIssue("--set a=1", "", "bad")]
    assert SpecError(issues).lines() == ["w.yaml:3 train.lr: unknown key 'lr'", "--set a=1: bad"]


@pytest.mark.parametrize(
    "error",
    [
        DataError("data.train.path", "no parquet files"),
        SpecError([SpecIssue("w.yaml:3", "train.lr", "unknown key 'lr'")]),
        PrecisionError("fp8 needs a GPU"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_survive_pickling_whatever_their_constructor(error: ShoalError) -> None:
    copy = pickle.loads(pickle.dumps(error))  # as a Ray worker's error reaches the driver
    assert type(copy) is type(error) and copy.lines() == error.lines() and str(copy) == str(error)
    assert getattr(copy, "issues", None) == getattr(error, "issues", None)


def _failing_validate(error: Exception):
    def validate(args):
        raise error

    return validate


@pytest.mark.parametrize(
    "error, expected",
    [
        (DataError("data.train.path", "no such file or directory: 'x'"), "data.train.path: no such file"),
        (ClusterError("no Ray cluster at --address '127.0.0.1:1'"), "no Ray cluster at --address"),
        (DegreeError("tp=3 makes 3 ranks but there are 4 workers"), "makes 3 ranks"),
        (PrecisionError("train.precision fp8 needs torchao"), "fp8 needs torchao"),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, Exception) else "",
)
def test_a_shoal_error_in_a_command_is_one_line_and_its_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, error: ShoalError, expected: str
) -> None:
    monkeypatch.setattr(cli, "cmd_validate", _failing_validate(error))
    assert cli.main(["validate", "w.yaml"]) == EXIT_USAGE
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], captured.err
    assert "Traceback" not in captured.err + captured.out


def test_a_subclass_chooses_its_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    class Unsupported(ShoalError):
        exit_code = 3

    monkeypatch.setattr(cli, "cmd_validate", _failing_validate(Unsupported("[not] markup", where="w.yaml:1")))
    assert cli.main(["validate", "w.yaml"]) == 3
    assert capsys.readouterr().err.strip() == "error: w.yaml:1: [not] markup"


def test_a_spec_error_shows_every_issue(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    issues = [SpecIssue("w.yaml:3", "train.lr", "unknown key 'lr'"), SpecIssue("w.yaml:5", "x", "bad")]
    monkeypatch.setattr(cli, "cmd_validate", _failing_validate(SpecError(issues)))
    assert cli.main(["validate", "w.yaml"]) == EXIT_USAGE
    err = capsys.readouterr().err.splitlines()
    assert err == ["error: w.yaml:3 train.lr: unknown key 'lr'", "error: w.yaml:5 x: bad"]


def test_other_exceptions_are_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "cmd_validate", _failing_validate(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["validate", "w.yaml"])
