"""Reading a workload: YAML (with line numbers) + `--set` overrides -> Workload.

Every problem becomes a `SpecIssue` naming where it came from (file and line,
or the `--set` that caused it) and the dotted path, so that the CLI can print
`workloads/x.yaml:12 train.optimizer.lr: must be > 0 (got -1)` and exit 2.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from shoal.errors import ShoalError
from shoal.spec import bounded_yaml
from shoal.spec.schema import Workload

# PyYAML follows YAML 1.1, where `1e-3` is a string; users mean a float.
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


@dataclass
class SpecIssue:
    where: str  # "file.yaml:12" or "--set a.b=c"
    path: str  # dotted path, "" for the whole document
    message: str

    def __str__(self) -> str:
        return f"{self.where} {self.path}: {self.message}" if self.path else f"{self.where}: {self.message}"


class SpecError(ShoalError):
    """One or more problems with a workload; `str()` is one line per problem."""

    def __init__(self, issues: list[SpecIssue]):
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


@dataclass
class Source:
    """Where each dotted path of the raw document came from."""

    file: str
    lines: dict[str, int] = field(default_factory=dict)
    overrides: dict[str, str] = field(default_factory=dict)

    def where(self, path: str) -> str:
        for key, item in self.overrides.items():  # a --set may create keys below `path`
            if key.startswith(f"{path}."):
                return f"--set {item}"
        probe = path
        while True:
            if probe in self.overrides:
                return f"--set {self.overrides[probe]}"
            if probe in self.lines:
                return f"{self.file}:{self.lines[probe]}"
            if not probe:
                return self.file
            probe = probe.rpartition(".")[0]


def parse_scalar(text: str, where: str = "--set") -> Any:
    """Type a `--set` value the way YAML would, with `1e-3` read as a float."""
    if _FLOAT.match(text.strip()) and len(text) < 100:
        number = float(text)
        return int(text) if re.fullmatch(r"[-+]?\d+", text.strip()) else number
    try:
        return bounded_yaml.parse(text)[0]
    except bounded_yaml.YamlProblem as exc:
        raise SpecError([SpecIssue(where, "", exc.message)]) from None


def _line_index(node: yaml.Node, prefix: str, lines: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = f"{prefix}.{key_node.value}" if prefix else str(key_node.value)
            lines[path] = key_node.start_mark.line + 1
            _line_index(value_node, path, lines)


def read_yaml(path: str | Path) -> tuple[dict[str, Any], Source]:
    shown = str(path)
    try:
        with open(path, "rb") as file:
            raw = file.read(bounded_yaml.MAX_BYTES + 1)  # never more than the limit, whatever the file
    except FileNotFoundError:
        raise SpecError([SpecIssue(shown, "", "no such file")]) from None
    except OSError as exc:
        raise SpecError([SpecIssue(shown, "", f"cannot read ({exc.strerror})")]) from None
    return parse_workload_text(raw, shown)


def parse_workload_text(raw: bytes | str, shown: str) -> tuple[dict[str, Any], Source]:
    """A workload document from any bytes (or text); `shown` names it in every problem."""
    try:
        text = bounded_yaml.decode(raw) if isinstance(raw, bytes) else raw
        data, node = bounded_yaml.parse(text)
    except bounded_yaml.YamlProblem as exc:
        where = f"{shown}:{exc.line}" if exc.line else shown
        raise SpecError([SpecIssue(where, "", exc.message)]) from None
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        raise SpecError([SpecIssue(shown, "", f"a workload must be a mapping of sections (got {got})")])
    source = Source(shown)
    if node is not None:
        _line_index(node, "", source.lines)
    return data, source


def apply_overrides(data: dict[str, Any], overrides: list[str], source: Source) -> None:
    for item in overrides:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise SpecError([SpecIssue(f"--set {item}", "", "expected KEY.PATH=VALUE")])
        *parents, leaf = key.split(".")
        target = data
        for depth, part in enumerate(parents):
            child = target.get(part)
            if child is None:
                child = target[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parents[: depth + 1])
                raise SpecError([SpecIssue(f"--set {item}", where, "is not a section")])
            target = child
        target[leaf] = parse_scalar(value, f"--set {item}")
        source.overrides[key] = item


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The valid keys of the section at `loc` (for suggesting a near miss)."""
    model: type[BaseModel] | None = Workload
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return []
        annotation = model.model_fields[part].annotation
        candidates = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)]
        model = next((a for a in candidates if issubclass(a, BaseModel)), None)
    if model is None:
        return []
    return [f.alias or name for name, f in model.model_fields.items()]


def describe_error(error: dict[str, Any]) -> str:
    kind, ctx, got = error["type"], error.get("ctx", {}), error.get("input")
    if kind == "extra_forbidden":
        name = str(error["loc"][-1])
        near = difflib.get_close_matches(name, _fields_at(error["loc"][:-1]), n=1, cutoff=0.5)
        return f"unknown key '{name}'" + (f" (did you mean '{near[0]}'?)" if near else "")
    if kind == "missing":
        return "is required"
    comparisons = {
        "greater_than": ">",
        "greater_than_equal": ">=",
        "less_than": "<",
        "less_than_equal": "<=",
    }
    if kind in comparisons:
        bound = next(iter(ctx.values()))
        shown = f"{bound:,}" if isinstance(bound, int) else f"{bound:g}"
        return f"must be {comparisons[kind]} {shown} (got {_short(got)})"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')} (got {_short(got)})"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return f"must be an integer (got {_short(got)})"
    if kind in ("float_parsing", "float_type"):
        return f"must be a number (got {_short(got)})"
    if kind == "string_type":
        return f"must be a string (got {_short(got)})"
    if kind in ("list_type", "tuple_type"):
        return f"must be a list (got {_short(got)})"
    if kind == "finite_number":
        return f"must be a finite number (got {got!r})"
    if kind in ("bool_parsing", "bool_type"):
        return f"must be true or false (got {_short(got)})"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping (got {_short(got)})"
    if kind == "string_pattern_mismatch":
        return f"must match {ctx.get('pattern')} (got {_short(got)})"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return f"{error['msg'][0].lower()}{error['msg'][1:]} (got {_short(got)})"


def _short(value: Any) -> str:
    """A bad value as the user wrote it, cut short: the message stays one line."""
    shown = repr(value)
    return shown if len(shown) <= 80 else f"{shown[:77]}..."


def _is_union_tag(part: Any) -> bool:
    # Union members add a tag to the location: 'int', 'constrained-int', 'function-after[...]'.
    return isinstance(part, str) and (
        part in ("int", "float", "bool", "str") or any(c in part for c in "-[(") or part[:1].isupper()
    )


def _clean_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(p for p in loc if not _is_union_tag(p))


def _issues_from(exc: ValidationError, source: Source) -> list[SpecIssue]:
    by_path: dict[str, list[dict[str, Any]]] = {}
    for error in exc.errors():
        by_path.setdefault(".".join(str(p) for p in _clean_loc(error["loc"])), []).append(error)
    issues = []
    for path, errors in by_path.items():
        if any(other.startswith(f"{path}.") for other in by_path) and all(
            isinstance(e.get("input"), dict) for e in errors
        ):
            continue  # the deeper error inside this mapping says more
        # A union reports once per member: for a mapping, the mapping member's error is the one.
        fitting = [e for e in errors if not isinstance(e.get("input"), dict) or "type" not in e["type"]]
        issues.append(SpecIssue(source.where(path), path, describe_error((fitting or errors)[0])))
    return issues


def validate_data(data: dict[str, Any], source: Source) -> Workload:
    try:
        return Workload.model_validate(data)
    except ValidationError as exc:
        raise SpecError(_issues_from(exc, source)) from None
