"""Writes corpus.jsonl: one document per line ({"text": ...}), the docstrings of Python's own
standard library (modules, classes and functions): English about code, found on any machine
with Python, nothing downloaded."""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path


def docstrings(limit: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) > 80:
                    found.append(text)
                    if len(found) == limit:
                        return found
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=str(Path(__file__).parent / "corpus.jsonl"))
    parser.add_argument("--documents", type=int, default=3000)
    args = parser.parse_args()
    documents = docstrings(args.documents)
    with open(args.out, "w", encoding="utf-8") as out:
        for text in documents:
            out.write(json.dumps({"text": text}) + "\n")
    print(f"wrote {len(documents)} documents to {args.out}")


if __name__ == "__main__":
    main()
