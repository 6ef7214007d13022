"""The scheduler's collaborators are passed at construction, not patched in afterwards: `Leases` gets the
result intake (results riding on beats) as an argument; no `self.<part>.<attr> = ...` in the scheduler's set-up
(`Scheduler.__init__`).
What the wiring does is shown by tests/controller/test_piggyback.py (results on beats, against the real API)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_no_collaborator_is_patched_after_construction():
    tree = ast.parse((REPO / "controller" / "work" / "scheduler.py").read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    patched = [f"line {n.lineno}" for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
               if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute)
               and isinstance(t.value.value, ast.Name) and t.value.value.id == "self"]
    assert patched == []
