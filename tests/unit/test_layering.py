"""shoal's layers, read from its source with `ast` (Ray Train V2 keeps test_circular_imports.py).

Every import counts, at module level or inside a function:
- worker/ (what runs in the training processes) imports no launch/, tracking/ or CLI;
- spec/ imports no worker/; data/ imports no launch/;
- no module imports another module's private (underscore) names;
- no import cycles between shoal modules;
- an import inside a function says why with a comment (start-up time, an optional library).
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import shoal

FORBIDDEN = (  # importer, the modules it must not import (a pattern; submodules too), in words
    ("shoal.worker", r"shoal\.(launch|tracking|cli\w*)", "launch/, tracking/ or the CLI"),
    ("shoal.spec", r"shoal\.worker", "worker/"),
    ("shoal.data", r"shoal\.launch", "launch/"),
)


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # the module imported (a submodule when `from package import submodule`)
    name: str | None  # the name taken from it with `from ... import name`
    line: int


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package whose directory is `root`."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _base(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    anchor = package[: len(package) - node.level + 1]
    return ".".join([*anchor, node.module] if node.module else anchor)


def imports_of(root: Path) -> list[Import]:
    """Every import of one package module by another, wherever in the file it is."""
    files = module_files(root)
    found = []
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [Import(module, a.name, None, node.lineno) for a in node.names if a.name in files]
            elif isinstance(node, ast.ImportFrom):
                base = _base(module, path.name == "__init__.py", node)
                for alias in node.names if base in files else ():
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                    found.append(Import(module, target, alias.name, node.lineno))
    return found


def _within(module: str, pattern: str) -> bool:
    return re.fullmatch(rf"{pattern}(\..+)?", module) is not None


def layer_violations(imports: list[Import]) -> list[str]:
    found = [
        f"{i.importer}:{i.line} imports {i.target} ({importer} must not import {words})"
        for i in imports
        for importer, imported, words in FORBIDDEN
        if _within(i.importer, re.escape(importer)) and _within(i.target, imported)
    ]
    return list(dict.fromkeys(found))  # one line per import statement


def private_imports(imports: list[Import]) -> list[str]:
    return [
        f"{i.importer}:{i.line} imports the private name {i.name} from {i.target}"
        for i in imports
        if i.name and i.name.startswith("_") and not i.name.endswith("__") and i.target != i.importer
    ]


def cycles(imports: list[Import]) -> list[list[str]]:
    """Groups of modules that import each other (strongly connected components, Tarjan)."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.target != i.importer:
            graph.setdefault(i.importer, set()).add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return groups


def _says_why(lines: list[str], function: ast.FunctionDef | ast.AsyncFunctionDef, line: int) -> bool:
    """A comment on the import's line or on one of the lines just above it, in the function."""
    above = range(max(function.body[0].lineno, line - 3), line + 1)
    return any("#" in lines[number - 1] for number in above) or lines[line - 2].strip().startswith("#")


def uncommented_deferrals(root: Path) -> list[str]:
    """Functions that import without a comment saying why the import is not at the top."""
    found = []
    for module, path in module_files(root).items():
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            inner = [n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
            if inner and not _says_why(lines, node, min(inner)):
                found.append(f"{module}:{min(inner)} imports inside {node.name}() without saying why")
    return found


def problems(root: Path) -> list[str]:
    imports = imports_of(root)
    found = layer_violations(imports) + private_imports(imports) + uncommented_deferrals(root)
    for group in cycles(imports):
        edges = [
            f"{i.importer}:{i.line} -> {i.target}" for i in imports if {i.importer, i.target} <= set(group)
        ]
        found.append(f"import cycle between {', '.join(group)}: {'; '.join(sorted(set(edges)))}")
    return found


def test_shoal_keeps_its_layers() -> None:
    assert problems(Path(shoal.__file__).parent) == []


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "shoal" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    for directory in [root / "shoal", *(root / "shoal").rglob("*")]:
        if directory.is_dir() and not (directory / "__init__.py").exists():
            (directory / "__init__.py").write_text("")
    return root / "shoal"


def test_the_checker_finds_every_kind_of_violation(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "cli_inspect.py": "",
            "launch/run.py": "from shoal.spec.loader import load\n",
            "tracking/recorder.py": "",
            "worker/loop.py": """
                import shoal.tracking.recorder

                def report():
                    from shoal import cli_inspect  # hidden in a function: still counted
            """,
            "worker/engine.py": "from ..launch import run\n",
            "spec/loader.py": """
                from shoal.worker.engine import Engine

                def _describe(): ...
                def load(): ...
            """,
            "spec/sweep.py": "from shoal.spec.loader import _describe\n",
            "data/sources.py": "def plan():\n    from shoal.launch.run import go\n",
            "data/parquet.py": "def read():\n    # deferred: only to read\n    import pyarrow\n",
        },
    )
    found = problems(root)
    expected = [
        "shoal.worker.loop:2 imports shoal.tracking.recorder",
        "shoal.worker.loop:5 imports shoal.cli_inspect",
        "shoal.worker.engine:1 imports shoal.launch.run",
        "shoal.spec.loader:2 imports shoal.worker.engine",
        "shoal.data.sources:2 imports shoal.launch.run",
        "shoal.spec.sweep:1 imports the private name _describe from shoal.spec.loader",
        "shoal.data.sources:2 imports inside plan() without saying why",
        "import cycle between shoal.launch.run, shoal.spec.loader, shoal.worker.engine",
    ]
    for problem in expected:
        assert any(line.startswith(problem) for line in found), (problem, found)
    assert len(found) == len(expected), found


def test_the_checker_passes_a_clean_package(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "launch/run.py": "from shoal.worker.loop import train\nfrom shoal import __version__\n",
            "worker/loop.py": "from shoal.spec.schema import Workload\nfrom .steps import step\n",
            "worker/steps.py": "def step(): ...\n",
            "spec/schema.py": "class Workload: ...\n",
        },
    )
    assert problems(root) == []
