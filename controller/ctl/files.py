"""The documents of `-f FILE|-` read for rolloutctl: parsed, each checked to be a mapping of finite numbers only.
Called by `apply` (`app.py`) and `policy apply` (`policy.py`); the documents, relative paths resolved, are sent.

Parsing (YAML or JSON, with line numbers) is `crds/kit/documents.py`'s; the relative paths of a job's spec are
resolved against the file's folder (`crds/spec_paths.py`). A problem ends the command through app.py's `fail`.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Callable

import typer

from rolloutd.crds import spec_paths
from rolloutd.crds.kit.documents import load_documents


def non_finite(doc: Any, path: str = "") -> str | None:
    """The path of the first NaN/Infinity in `doc` (JSON, and so the API, has neither), or None."""
    stack = [(doc, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return f"{where}: {node} is not a finite number"
        if isinstance(node, dict):
            stack.extend((v, f"{where}.{k}" if where else str(k)) for k, v in reversed(list(node.items())))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(node))))
    return None


def read_documents(filename: str, fail: Callable[[str], typer.Exit], kind: str = "RolloutJob") -> list[dict[str, Any]]:
    """The documents of `filename` ("-": stdin), each a `kind` mapping, checked, their relative paths resolved; a
    problem: `raise fail(…)`."""
    try:
        text = sys.stdin.read() if filename == "-" else Path(filename).read_text()
    except OSError as e:
        raise fail(f"cannot read {filename}: {e.strerror}") from None
    try:
        docs = load_documents(text, filename)
    except ValueError as e:
        raise fail(str(e)) from None
    if not docs:
        raise fail(f"{filename}: no documents")
    for d in docs:
        if not isinstance(d, dict):
            raise fail(f"{filename}: expected a {kind} mapping, got {type(d).__name__}")
        if problem := non_finite(d):
            raise fail(f"{filename}: {problem} (JSON, and so the API, has no NaN or infinities)")
    return [spec_paths.resolve_paths(d, Path(filename).parent if filename != "-" else Path.cwd()) for d in docs]
