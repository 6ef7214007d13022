"""The structure rules of issue 12, checked over the product packages (crds, sandbox, agents, controller):
no import cycles, imports that flow crds ← sandbox ← agents ← controller, small modules and classes, a
docstring at the top of every module.

Reads the sources with `ast` (nothing is imported). The allow-lists name today's offenders with the
reason; a module that stops offending must leave its list (the test says so), so the lists only shrink.
"""
from __future__ import annotations

import ast
import subprocess
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("crds", "sandbox", "agents", "controller")
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 300

# Modules in an import cycle today → why (trimmed as the structure re-cut lands).
CYCLES_ALLOWED: dict[str, str] = {
}
# Modules over MAX_MODULE_LINES, or holding a class over MAX_CLASS_LINES, today → why.
SIZE_ALLOWED: dict[str, str] = {
}
# What a part may import of rolloutd (prefixes of module names); everything else of rolloutd is refused.
ALLOWED_IMPORTS: dict[str, tuple[str, ...]] = {
    "crds": ("rolloutd.crds",),
    "sandbox": ("rolloutd.crds", "rolloutd.sandbox"),
    "agents": ("rolloutd.crds", "rolloutd.sandbox", "rolloutd.agents"),
    # the controller side uses the node side's dataset expansion and its waiting kit, nothing else
    "controller": ("rolloutd.crds", "rolloutd.sandbox", "rolloutd.agents.tasks",
                   "rolloutd.controller", "rolloutd.client", "rolloutd.integrations"),
}
# Imports outside ALLOWED_IMPORTS that stay for a reason (importer, imported) → why.
LAYERS_ALLOWED: dict[tuple[str, str], str] = {
}


def _modules() -> dict[str, tuple[str, Path]]:
    """Module name → (part, file), the names as installed (pyproject's package-dir)."""
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    folders = {Path(folder): package for package, folder in package_dir.items()}
    out = {}
    for part in PRODUCT:
        for path in sorted((REPO / part).rglob("*.py")):
            if not (path.parent / "__init__.py").exists():
                continue  # a file outside any package of ours
            rel = path.relative_to(REPO)
            owner = max((f for f in folders if rel.parts[:len(f.parts)] == f.parts), key=lambda f: len(f.parts))
            rest = list(rel.with_suffix("").parts[len(owner.parts):])
            if rest[-1:] == ["__init__"]:
                rest = rest[:-1]
            out[".".join([folders[owner], *rest])] = (part, path)
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, (_, path) in MODULES.items()}


def _imports(name: str) -> set[str]:
    """The rolloutd modules `name` imports anywhere in its body (module level, functions, TYPE_CHECKING),
    each resolved to the module file it loads (`from pkg import mod` → pkg.mod)."""
    package = name if MODULES[name][1].name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import rolloutd.x.y` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _size_problems(source: str) -> list[str]:
    problems = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        problems.append(f"{lines} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
            problems.append(f"class {node.name} {node.end_lineno - node.lineno + 1} lines")
    return problems


def _oversized() -> dict[str, str]:
    return {name: ", ".join(problems) for name, (_, path) in MODULES.items()
            if (problems := _size_problems(path.read_text()))}


def test_the_checker_sees_every_part_and_resolves_imports():
    assert {part for part, _ in MODULES.values()} == set(PRODUCT)
    assert "rolloutd.client.core" in MODULES and "rolloutd.controller.http.node_protocol" in MODULES
    assert "rolloutd.crds.names" in GRAPH["rolloutd.controller.http.node_protocol"]  # absolute import
    assert "rolloutd.controller.http.bodies" in GRAPH["rolloutd.controller.http.node_protocol"]  # relative, same package
    assert "rolloutd.controller.errors" in GRAPH["rolloutd.controller.http.trainer"]  # relative, parent package
    assert "rolloutd.client.batch" in GRAPH["rolloutd.client.core"]  # function-level import


def test_no_import_cycles():
    in_cycles = {m: cycle for cycle in _cycles(GRAPH) for m in cycle}
    new = {m: c for m, c in in_cycles.items() if m not in CYCLES_ALLOWED}
    assert not new, f"import cycles (break them with a module both sides import): {sorted(map(tuple, new.values()))}"
    fixed = sorted(set(CYCLES_ALLOWED) - set(in_cycles))
    assert not fixed, f"no longer in a cycle: remove from CYCLES_ALLOWED: {fixed}"


def test_imports_flow_crds_sandbox_agents_controller():
    crossing = {(name, target) for name, (part, _) in MODULES.items() for target in GRAPH[name]
                if not target.startswith(ALLOWED_IMPORTS[part])}
    assert sorted(crossing - set(LAYERS_ALLOWED)) == []
    assert sorted(set(LAYERS_ALLOWED) - crossing) == [], "no longer imported: remove from LAYERS_ALLOWED"


def test_modules_and_classes_stay_small():
    oversized = _oversized()
    new = {m: why for m, why in oversized.items() if m not in SIZE_ALLOWED}
    assert not new, f"over {MAX_MODULE_LINES} lines per module / {MAX_CLASS_LINES} per class: {new}"
    fixed = sorted(set(SIZE_ALLOWED) - set(oversized))
    assert not fixed, f"small enough now: remove from SIZE_ALLOWED: {fixed}"


@pytest.mark.parametrize("listing", [CYCLES_ALLOWED, SIZE_ALLOWED], ids=["cycles", "sizes"])
def test_allow_lists_name_real_modules(listing):
    assert sorted(set(listing) - set(MODULES)) == []


def test_the_checks_catch_what_they_claim_to():
    """The cycle finder and the size measure on made-up input (the real tree may have no offender left)."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _size_problems("class Big:\n" + "    x = 1\n" * MAX_CLASS_LINES) == [f"class Big {MAX_CLASS_LINES + 1} lines"]
    assert _size_problems("x = 1\n" * (MAX_MODULE_LINES + 1)) == [f"{MAX_MODULE_LINES + 1} lines"]
    assert _size_problems("x = 1\n" * MAX_MODULE_LINES) == []


# --- tests/, bench/ and sim/ (issues 26, 40): tests and benches share only the product and the stand-ins (tests/support/sim/) ---
TESTS, BENCH, SIM = REPO / "tests", REPO / "bench", REPO / "tests" / "support" / "sim"
# The one package of tests/ that bench/ may import (issue 40: the stand-ins left the wheel for tests/support/sim).
SHARED = "support.sim"
# The sys.path edits bench/ makes, exactly as written → why (any other edit, of any path, is refused).
BENCH_SYS_PATH: dict[tuple[str, str], str] = {
    ("bench/__init__.py", "sys.path.append(_TESTS)"): "tests/ on the path for support.sim (SHARED), and only for it",
    ("bench/bench_pipeline.py", "sys.path.insert(0, str(PLUGINS))"):
        "the bench-noop plug-in folder (support.sim.noop.PLUGINS), found through its dist-info as a daemon finds it",
}


def _imported(path: Path) -> set[str]:
    """The modules a file imports, as written (absolute imports only: tests/ and bench/ use no relative ones
    across folders; `from a import b` counts as `a`)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _top_imports(path: Path) -> set[str]:
    """The top-level names a file imports."""
    return {name.split(".")[0] for name in _imported(path)}


def _of_tests_but_not_shared(path: Path) -> set[str]:
    """What a file imports of tests/ (`tests.*`, `support.*`) other than the shared stand-ins (SHARED)."""
    return {name for name in _imported(path) if name.split(".")[0] in ("tests", "support")
            and name != SHARED and not name.startswith(SHARED + ".")}


def _sys_path_edits(path: Path) -> list[str]:
    """`sys.path.insert(…)` / `.append(…)` calls in a file, as source text."""
    source = path.read_text()
    return [ast.get_source_segment(source, node) for node in ast.walk(ast.parse(source, str(path)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("insert", "append") and ast.unparse(node.func.value) == "sys.path"]


def _py(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "harness_tasks" not in p.parts)


def test_tests_and_bench_do_not_import_each_other():
    """bench/ measures, tests/ proves: neither imports the other, except that bench/ uses the stand-ins of
    tests/support/sim/ (`support.sim`, not in the wheel) through one sys.path entry; support.sim imports
    neither bench/ nor the rest of tests/."""
    bench_in_tests = {str(p.relative_to(REPO)) for p in _py(TESTS) if "bench" in _top_imports(p)}
    tests_in_bench = {str(p.relative_to(REPO)) for p in _py(BENCH) + _py(SIM) if _of_tests_but_not_shared(p)}
    edits = {(str(p.relative_to(REPO)), edit) for p in _py(BENCH) + _py(SIM) for edit in _sys_path_edits(p)}
    assert sorted(edits - set(BENCH_SYS_PATH)) == [], "a sys.path edit in bench/ or support.sim not in BENCH_SYS_PATH"
    assert sorted(set(BENCH_SYS_PATH) - edits) == [], "no longer made: remove from BENCH_SYS_PATH"
    assert (sorted(bench_in_tests), sorted(tests_in_bench)) == ([], [])


def test_the_import_rules_see_what_they_claim_to(tmp_path):
    """The readers on made-up files: an import of bench, one of tests/ beyond support.sim and a sys.path edit
    are found; support.sim itself is not."""
    (tmp_path / "a.py").write_text("import sys\nsys.path.insert(0, 'tests/slurm')\nfrom bench.x import y\n"
                                   "import support.sim.noop\nfrom support.sim import module_command\n"
                                   "from support.simulated import z\nimport support.waiting\n")
    assert _top_imports(tmp_path / "a.py") == {"sys", "bench", "support"}
    assert _of_tests_but_not_shared(tmp_path / "a.py") == {"support.simulated", "support.waiting"}
    assert _sys_path_edits(tmp_path / "a.py") == ["sys.path.insert(0, 'tests/slurm')"]


# Files under tests/ that are scripts run in a process of their own, not imported by pytest → why they edit sys.path.
SYS_PATH_SCRIPTS: dict[str, str] = {
    "tests/rl/grpo_checks.py": "run by the engine venv's interpreter; it imports the example trainer (examples/rl)",
}


def test_tests_import_their_helpers_from_support_not_through_sys_path():
    """The shared helpers are the package tests/support (pyproject puts tests/ on pytest's sys.path), so no test
    file or conftest edits sys.path to reach a neighbour's helpers."""
    edits = {str(p.relative_to(REPO)): _sys_path_edits(p) for p in _py(TESTS)}
    edits = {path: found for path, found in edits.items() if found and path not in SYS_PATH_SCRIPTS}
    assert edits == {}
    assert "tests" in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["pythonpath"]


def test_bench_keeps_code_at_its_top_and_results_under_results():
    """bench/: the benchmarks' code at the top, what they measured (RESULTS-*.md, figures, raw JSON, gzipped when it
    keeps every sample) in bench/results/."""
    tracked = subprocess.run(["git", "ls-files", "bench"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    misplaced = [f for f in tracked if not f.startswith("bench/results/") and not f.endswith(".py")]
    assert misplaced == []
    kinds = {"".join(Path(f).suffixes[-2:]) if f.endswith(".gz") else Path(f).suffix
             for f in tracked if f.startswith("bench/results/")}
    assert kinds <= {".md", ".png", ".json", ".json.gz", ".csv", ""}


# --- independence (issue 26, kopf-style contracts): parts that must stand without another ---------------------
# importer prefix → (the rolloutd prefixes it may import, why)
INDEPENDENT: dict[str, tuple[tuple[str, ...], str]] = {
    # the trainer's client runs in the trainer's venv: it talks to the controller over HTTP, never imports it
    "rolloutd.client": (("rolloutd.client", "rolloutd.crds"), "the client imports nothing of the controller or the node"),
    # the exec server runs inside the sandbox: it knows nothing of the node daemon that asked for it
    "rolloutd.sandbox.server": (("rolloutd.sandbox", "rolloutd.crds"), "the sandbox server imports nothing of the node"),
}
# Imports that break a contract today → why; each is an expected failure (strict): when the import goes, the
# test passes unexpectedly and fails until its line here is removed, so the list only shrinks.
INDEPENDENCE_KNOWN: dict[tuple[str, str], str] = {
}


def _contract_breaks() -> set[tuple[str, str]]:
    return {(name, target) for prefix, (allowed, _) in INDEPENDENT.items() for name in MODULES
            if name == prefix or name.startswith(prefix + ".")
            for target in GRAPH[name] if not target.startswith(allowed)}


def test_independent_parts_import_only_what_their_contract_allows():
    new = sorted(_contract_breaks() - set(INDEPENDENCE_KNOWN))
    assert new == [], f"{new}: {[INDEPENDENT[p][1] for p in INDEPENDENT if any(n.startswith(p) for n, _ in new)]}"


@pytest.mark.parametrize("importer,imported", [
    pytest.param(*pair, marks=pytest.mark.xfail(strict=True, reason=f"known, to be removed: {why}"), id=f"{pair[0]}->{pair[1]}")
    for pair, why in INDEPENDENCE_KNOWN.items()])
def test_a_known_contract_break_is_gone(importer, imported):
    assert imported not in GRAPH[importer]


# Layerings inside the controller and the sandbox part (issue 40): importer prefix → (the prefix it must not import, why)
FORBIDDEN: dict[str, tuple[str, str]] = {
    "rolloutd.controller.store": ("rolloutd.controller.kube", "the store sits below the API: the selectors are "
                                  "`controller/selectors.py`, which both import"),
    "rolloutd.controller.ctl": ("rolloutd.controller.ui", "rolloutctl (`controller/ctl/`) does not import the web "
                                "UI: the decoder both use is `controller/decode.py`"),
    "rolloutd.controller.work": ("rolloutd.controller.http", "the work core does not import the routes"),
    "rolloutd.controller.executors": ("rolloutd.sandbox", "an executor launches daemons; it imports nothing of the "
                                      "sandbox"),
    # inside the sandbox part (issue 40): the host's confinement builds on the server's launch, not the other way
    "rolloutd.sandbox.launch": ("rolloutd.sandbox.host", "the launch configuration imports nothing of the host's "
                                "confinement: the sandbox id's variable is `launch.ID_VAR`, which `host/` imports"),
}
# Exceptions that stay, each with why it cannot go (and a test that it is still needed, so a stale one is flagged)
FORBIDDEN_ALLOWED: dict[tuple[str, str], str] = {
    # the exec server starts with `-I -S` and only its own folder on sys.path (sandbox/launch.py), so the stdlib /proc
    # parser it needs must live there; the local executor needs the same parse (a live, non-zombie pid's start time,
    # the identity its state file keeps) — the alternatives are a second copy or psutil's create_time, which would
    # change local-executor.json's format under daemons that outlive an upgrade (issue 40, third pass)
    ("rolloutd.controller.executors.local", "rolloutd.sandbox.server.procs"):
        "the one stdlib /proc parser, held in the exec server's folder",
}


def _forbidden_imports() -> set[tuple[str, str]]:
    return {(name, target) for prefix, (banned, _) in FORBIDDEN.items() for name in MODULES
            if name.startswith(prefix) for target in GRAPH[name] if target.startswith(banned)}


def test_the_controller_layers_hold():
    assert sorted(_forbidden_imports() - set(FORBIDDEN_ALLOWED)) == []


@pytest.mark.parametrize("importer,imported", list(FORBIDDEN_ALLOWED), ids=lambda x: x)
def test_an_allowed_exception_is_still_needed(importer, imported):
    assert imported in GRAPH[importer], f"{importer} no longer imports {imported}: drop it from FORBIDDEN_ALLOWED"


def test_the_contracts_name_real_packages():
    for prefix in INDEPENDENT:
        assert prefix in MODULES and any(name.startswith(prefix + ".") for name in MODULES)
    for prefix, (banned, _) in FORBIDDEN.items():  # a renamed module must not leave its layering unchecked
        assert any(name.startswith(prefix) for name in MODULES) and any(n.startswith(banned) for n in MODULES), prefix
