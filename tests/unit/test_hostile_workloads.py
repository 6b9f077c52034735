"""Any bytes as a workload file: one clear SpecError (exit 2), never a traceback or a hang.

In-process: named hostile inputs, then property tests (hypothesis) over raw bytes, over
generated YAML trees and over a valid workload with one value replaced. Through the
real CLI: a handful of the same, checking the exit code, the one line and that nothing
was written.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal import spec
from shoal.errors import ShoalError
from shoal.spec.loader import SpecError, parse_workload_text, validate_data

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = (ROOT / "workloads" / "quickstart.yaml").read_text()


def _alias_bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _with(old: str, new: str) -> str:
    assert old in QUICKSTART
    return QUICKSTART.replace(old, new)


def _edit(old: str, new: str, says: str) -> tuple[bytes, str]:
    """The quickstart with one edit, as bytes, and what the one line must say about it."""
    return _with(old, new).encode(), says


# name -> (the file's bytes, what the one line must say)
HOSTILE: dict[str, tuple[bytes, str]] = {
    "not UTF-8": (b"\xff\xfe\x00garbage", "not UTF-8 text (byte 0xff at offset 0)"),
    "binary": (bytes(range(256)) * 4, "not UTF-8 text"),
    "NUL in text": (b"name: a\x00b\n", "malformed YAML"),
    "empty": (b"", "a workload must be a mapping of sections (got an empty file)"),
    "only a comment": (b"# nothing\n", "(got an empty file)"),
    "a list": (b"- a\n- b\n", "(got a list)"),
    "a scalar": (b"42\n", "(got a int)"),
    "enormous": (b"name: '" + b"x" * (2 << 20) + b"'\n", "too large for a workload file"),
    "alias bomb": (_alias_bomb().encode(), "expands to more than 100,000 values"),
    "alias bomb under a section": (
        (_alias_bomb() + "model: {family: cnn, args: {channels: *a8}}\n").encode(),
        "expands to more than 100,000 values",
    ),
    "recursive alias": (b"a: &a [*a]\n", "refers to no finished anchor"),
    "undefined alias": (b"a: *nowhere\n", "refers to no finished anchor"),
    "deep flow nesting": (b"name: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested more than 32 levels deep"),
    "deep block nesting": (
        "".join(" " * i + f"k{i}:\n" for i in range(200)).encode(),
        "nested more than 32 levels deep",
    ),
    "duplicate key": _edit("name: quickstart", "name: quickstart\nname: other", "duplicate key 'name'"),
    "duplicate nested key": _edit(
        "max_steps: 400",
        "max_steps: 400\n  max_steps: 4",
        "duplicate key 'max_steps' (first given on line 10)",
    ),
    "python tag": _edit(
        "name: quickstart",
        'name: !!python/object/apply:os.system ["touch pwned"]',
        "could not determine a constructor",
    ),
    "custom tag": _edit("name: quickstart", "name: !custom x", "could not determine a constructor"),
    "bad float tag": (_with("lr: 3.0e-3", "lr: !!float abc"), "malformed YAML"),
    "two documents": (b"name: a\n---\nname: b\n", "malformed YAML"),
    "tab indentation": (b"model:\n\tfamily: cnn\n", "malformed YAML"),
    "true as a step count": _edit("max_steps: 400", "max_steps: true", "must be an integer (got True)"),
    "string as a step count": _edit("max_steps: 400", "max_steps: '400'", "must be an integer (got '400')"),
    "float as a step count": _edit("max_steps: 400", "max_steps: 400.0", "must be an integer (got 400.0)"),
    "yes as a flag": _edit("async: false", "async: 'yes'", "must be true or false"),
    "steps far out of range": _edit(
        "max_steps: 400", "max_steps: 99999999999999999999999", "must be <= 1,000,000,000"
    ),
    "1e300 steps": _edit("max_steps: 400", "max_steps: 1e300", "must be an integer"),
    "infinite lr": _edit("lr: 3.0e-3", "lr: .inf", "must be a finite number (got inf)"),
    "nan lr": _edit("lr: 3.0e-3", "lr: .nan", "must be a finite number (got nan)"),
    "huge lr": _edit("lr: 3.0e-3", "lr: 1e30", "must be <= 100"),
    "negative seed": _edit("seed: 0", "seed: -1", "must be >= 0"),
    "a million workers": _edit("workers: 2", "workers: 1000000", "must be <= 100,000"),
    "workers as a list": _edit("workers: 2", "workers: [1, true]", "scaling.workers"),
    "path-like target": _edit("family: cnn", "target: ../../etc/passwd:X", "model.target: must look like"),
    "relative target": _edit("family: cnn", "target: .relative:Net", "model.target: must look like"),
    "target without a class": _edit("family: cnn", "target: 'os:'", "model.target: must look like"),
    "target with spaces": _edit("family: cnn", "target: 'os :system'", "model.target: must look like"),
    "target not a module": _edit("family: cnn", "target: 'os:system'", "is not a torch.nn.Module subclass"),
    "target missing": _edit("family: cnn", "target: 'no_such_pkg_x.m:Net'", "cannot import module"),
    "model arg as bool": _edit("channels: 32", "channels: true", "model.args.channels: must be an integer"),
    "model arg out of range": _edit("channels: 32", "channels: 10000000", "must be in [1, 4096]"),
    "global batch larger than the data": _edit(
        "global_batch_size: 128", "global_batch_size: 1048576", "more than the 1,438 rows of the training set"
    ),
    "non-string key": _edit("name: quickstart", "name: quickstart\n1: x", "keys should be strings"),
}


@pytest.fixture(scope="module")
def digits_prepared() -> None:
    from shoal.data.builtin import prepare

    prepare("digits")  # the data-size check counts the prepared corpus


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_workload_is_one_clear_spec_error(name: str, tmp_path: Path, digits_prepared: None) -> None:
    content, expected = HOSTILE[name]
    path = tmp_path / "w.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(SpecError) as caught:
        spec.load(path, prepare_data=True)
    lines = caught.value.lines()
    assert any(expected in line for line in lines), lines
    assert all("\n" not in line and len(line) < 400 for line in lines)
    assert all(line.startswith(str(path)) for line in lines)  # each names where it is
    assert not (tmp_path / "pwned").exists()


def _outcome(content: bytes) -> None:
    """Parsing and validating any bytes ends in a Workload or a SpecError; lines are single."""
    try:
        data, source = parse_workload_text(content, "w.yaml")
        validate_data(data, source)
    except SpecError as exc:
        assert exc.lines() and all("\n" not in line for line in exc.lines())


FAST = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.binary(max_size=2048))
def test_any_bytes_are_a_workload_or_a_spec_error(content: bytes) -> None:
    _outcome(content)


@FAST
@given(st.text(alphabet=st.sampled_from(list("ab:-[]{}&*!|>'\"#,? \n\t0.1e")), max_size=300))
def test_yaml_punctuation_soup_is_a_workload_or_a_spec_error(text: str) -> None:
    _outcome(text.encode())


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
TREES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@FAST
@given(TREES)
def test_any_yaml_tree_is_a_workload_or_a_spec_error(tree: object) -> None:
    _outcome(yaml.safe_dump(tree).encode())


def _leaf_paths(node: object, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(node, dict):
        return [p for key, value in node.items() for p in _leaf_paths(value, (*prefix, key))]
    return [prefix]


BASE = yaml.safe_load(QUICKSTART)
LEAVES = _leaf_paths(BASE)
SCHEMA_LEAVES = [
    p for p in LEAVES if p[:2] != ("model", "args")
]  # args are the model's: spec.load checks them


def _get(node: object, path: tuple[str, ...]) -> object:
    for part in path:
        node = node[part]
    return node


def _replaced(path: tuple[str, ...], value: object) -> dict:
    data = yaml.safe_load(QUICKSTART)
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return data


@settings(max_examples=200, deadline=2000)
@given(st.sampled_from(SCHEMA_LEAVES), TREES)
def test_one_value_replaced_by_anything_is_a_workload_or_names_its_path(
    path: tuple[str, ...], value: object
) -> None:
    try:
        data, source = parse_workload_text(yaml.safe_dump(_replaced(path, value)), "w.yaml")
        validate_data(data, source)
    except SpecError as exc:
        assert all("\n" not in line for line in exc.lines())
        return
    original = _get(BASE, path)
    if isinstance(original, int) and not isinstance(original, bool):
        assert value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)), (
            path,
            value,
        )
    if isinstance(original, bool):
        assert value is None or isinstance(value, bool), (path, value)


@pytest.mark.parametrize(
    "path", [p for p in SCHEMA_LEAVES if type(_get(BASE, p)) in (int, float)], ids=".".join
)
def test_true_is_refused_wherever_a_number_is_expected(path: tuple[str, ...]) -> None:
    data, source = parse_workload_text(yaml.safe_dump(_replaced(path, True)), "w.yaml")
    with pytest.raises(SpecError, match=f"{'.'.join(path)}: must be"):
        validate_data(data, source)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(path=st.sampled_from(LEAVES), value=TREES)
def test_the_full_checks_end_in_a_spec_error_or_a_workload(
    path: tuple[str, ...], value: object, tmp_path: Path
) -> None:
    """The checks past the schema (model import and args, the meta-device trace, data
    planning) see whatever the schema lets through; they too answer with a ShoalError."""
    target = tmp_path / "w.yaml"
    target.write_text(yaml.safe_dump(_replaced(path, value)))
    try:
        spec.load(target)
    except ShoalError as exc:
        assert all("\n" not in line for line in exc.lines())


# Through the real CLI: exit 2, one line on stderr, no traceback, nothing written.
CLI_CASES = [
    "not UTF-8",
    "alias bomb",
    "enormous",
    "duplicate key",
    "true as a step count",
    "path-like target",
]


def _shoal(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(cwd / "home"), "SHOAL_DATA_CACHE": str(cwd / "cache")}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(
        [sys.executable, "-m", "shoal.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "command,name",
    [("validate", name) for name in CLI_CASES]
    + [("run", "duplicate key"), ("sweep", "alias bomb"), ("submit", "not UTF-8")],
)
def test_the_cli_answers_a_hostile_file_with_exit_2_and_one_line(
    command: str, name: str, tmp_path: Path
) -> None:
    content, expected = HOSTILE[name]
    (tmp_path / "w.yaml").write_bytes(content if isinstance(content, bytes) else content.encode())
    before = sorted(p.name for p in tmp_path.iterdir())
    extra = ["--address", "http://127.0.0.1:1"] if command == "submit" else []
    done = _shoal([command, "w.yaml", *extra], tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and lines[0].startswith("error: w.yaml"), done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no shoal_runs, mlflow.db, cache
