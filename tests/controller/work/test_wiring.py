"""The controller is wired in one place (`controller/root.py`, `work/core.build_work`): every part gets its
collaborators as arguments, nothing is patched onto a part, the app, the store or a module afterwards, and the
scheduler keeps only its own logic (no method that just forwards to a part).
What the wiring does is shown by tests/controller/http/test_piggyback.py (results on beats, against the real API)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from rolloutd.controller.root import assemble
from rolloutd.controller.store import Store
from rolloutd.controller.work.scheduler import Scheduler

REPO = Path(__file__).resolve().parents[3]
CONTROLLER = REPO / "controller"


def _patched(fn: ast.AST) -> list[str]:
    """`x.y.z = …` inside `fn`: an attribute set on a part after it was made."""
    return [f"line {n.lineno}" for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute)
            and ast.unparse(t) != "app.router.lifespan_context"]  # FastAPI's own way to set the lifespan


def test_no_collaborator_is_patched_after_construction():
    for path, name in (("work/core.py", "build_work"), ("root.py", "assemble"), ("server.py", "build_app")):
        tree = ast.parse((CONTROLLER / path).read_text())
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
        assert _patched(fn) == [], path


def test_no_side_door_is_left():
    """Parts reach the routes as arguments: not through `app.state`, a singleton kept on the store, or a module
    global set at start."""
    doors = re.compile(r"app\.state|_tenant_policies|policies_for|SHARED_FILESYSTEM|(?<!self)\.observe_step = ")
    found = [f"{p.relative_to(REPO)}:{i}" for p in CONTROLLER.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if doors.search(line)]
    assert found == []


def test_the_scheduler_does_not_forward():
    """No method of `Scheduler` is a one-statement call of a part's method (the routes call the part)."""
    tree = ast.parse((CONTROLLER / "work" / "scheduler.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Scheduler")
    forwards = []
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or fn.name.startswith("__"):
            continue
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, (ast.Call, ast.Await)):
            call = body[0].value.value if isinstance(body[0].value, ast.Await) else body[0].value
            if isinstance(call, ast.Call) and ast.unparse(call.func).startswith("self.work."):
                forwards.append(fn.name)
    assert forwards == [], "call the part from the route"


def test_one_set_of_running_sums_and_policies_serves_every_reader(tmp_path):
    root = assemble(Store(tmp_path / "db.sqlite"), "admin", work={})
    assert isinstance(root.scheduler, Scheduler) and root.scheduler.work is root.work
    assert root.work.stats is root.stats and root.streams.policies is root.policies
    assert root.jobs.policies is root.policies and root.jobs.streams is root.streams
