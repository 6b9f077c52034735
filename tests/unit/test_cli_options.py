"""The options shared by several subcommands (parent parsers) parse as before everywhere."""

from __future__ import annotations

import pytest

from shoal.cli import _parser

OVERRIDES = ["--set", "train.max_steps=5", "--set", "train.seed=1"]
SET = {"overrides": ["train.max_steps=5", "train.seed=1"]}

CASES = {
    "run": (
        ["run", "w.yaml", *OVERRIDES, "--address", "h:1", "--run-name", "r", "--verbose"],
        {**SET, "address": "h:1", "run_name": "r", "verbose": True, "file": "w.yaml", "mlflow_run_id": None},
    ),
    "resume": (
        ["resume", "abc", "--tracking-uri", "sqlite:///x.db", "--address", "h:1", "--verbose"],
        {"run_id": "abc", "tracking_uri": "sqlite:///x.db", "address": "h:1", "verbose": True},
    ),
    "sweep": (
        ["sweep", "w.yaml", *OVERRIDES, "--address", "h:1", "--name", "s", "--resume", "--verbose"],
        {**SET, "address": "h:1", "name": "s", "resume": True, "verbose": True},
    ),
    "submit": (
        ["submit", "w.yaml", *OVERRIDES, "--address", "http://h:8265", "--run-name", "r", "--detach"],
        {**SET, "address": "http://h:8265", "run_name": "r", "detach": True, "working_dir": None},
    ),
    "jobs": (
        ["jobs", "status", "j1", "--address", "http://h:8265", "--format", "json"],
        {"action": "status", "job_id": "j1", "address": "http://h:8265", "format": "json", "follow": False},
    ),
    "validate": (["validate", "w.yaml", *OVERRIDES], {**SET, "file": "w.yaml"}),
    "plan": (
        ["plan", "w.yaml", *OVERRIDES, "--gpu", "h100-80gb", "--gpus", "8", "--format", "json"],
        {**SET, "gpu": "h100-80gb", "gpus": 8, "nodes": 1, "format": "json", "write": None},
    ),
    "doctor": (
        ["doctor", "w.yaml", *OVERRIDES, "--address", "h:1", "--format", "json"],
        {**SET, "file": "w.yaml", "address": "h:1", "format": "json"},
    ),
    "runs list": (
        ["runs", "list", "--tracking-uri", "sqlite:///x.db", "--format", "json", "--limit", "3"],
        {"tracking_uri": "sqlite:///x.db", "format": "json", "limit": 3, "experiment": None},
    ),
    "runs show": (
        ["runs", "show", "r", "--tracking-uri", "sqlite:///x.db"],
        {"run": "r", "tracking_uri": "sqlite:///x.db", "format": "table"},
    ),
    "runs compare": (
        ["runs", "compare", "a", "b", "--format", "json"],
        {"run": ["a", "b"], "tracking_uri": None, "format": "json"},
    ),
}

DEFAULTS = {
    "run": {"overrides": [], "address": None, "run_name": None, "verbose": False},
    "resume": {"tracking_uri": None, "address": None, "verbose": False},
    "sweep": {"overrides": [], "address": None, "verbose": False, "resume": False},
    "submit": {"overrides": [], "address": None, "run_name": None},
    "jobs": {"address": None, "format": "table"},
    "validate": {"overrides": []},
    "doctor": {"overrides": [], "address": None, "format": "table", "file": None},
    "runs list": {"tracking_uri": None, "format": "table", "limit": 50},
}
REQUIRED = {"run": ["w.yaml"], "resume": ["abc"], "sweep": ["w.yaml"], "submit": ["w.yaml"]}
REQUIRED |= {"jobs": ["list"], "validate": ["w.yaml"]}


@pytest.mark.parametrize("command", CASES)
def test_shared_options_parse_for_each_subcommand(command: str) -> None:
    argv, expected = CASES[command]
    args = vars(_parser().parse_args(argv))
    assert {key: args[key] for key in expected} == expected


@pytest.mark.parametrize("command", DEFAULTS)
def test_shared_options_default_as_before(command: str) -> None:
    args = vars(_parser().parse_args([*command.split(), *REQUIRED.get(command, [])]))
    assert {key: args[key] for key in DEFAULTS[command]} == DEFAULTS[command]


def test_overrides_do_not_leak_between_parses() -> None:
    parser = _parser()
    parser.parse_args(["validate", "w.yaml", "--set", "a=1"])
    assert parser.parse_args(["validate", "w.yaml"]).overrides == []


@pytest.mark.parametrize("command", ["", *sorted({c.split()[0] for c in CASES}), "runs list", "data prepare"])
def test_every_help_works(command: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args([*command.split(), "--help"])
    assert exit_.value.code == 0 and "usage: shoal" in capsys.readouterr().out


def test_format_accepts_only_table_or_json(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["runs", "list", "--format", "yaml"])
    assert exit_.value.code == 2 and "invalid choice: 'yaml'" in capsys.readouterr().err
