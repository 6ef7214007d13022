"""The distribution installs one namespace (`rolloutd.*`) covering every source folder."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# folder → package; a nested folder may be its own top-level package (controller/client is
# `rolloutd.client`, the trainer client, not `rolloutd.controller.client`)
PARTS = {"crds": "rolloutd.crds", "controller": "rolloutd.controller", "agents": "rolloutd.agents",
         "sandbox": "rolloutd.sandbox", "controller/client": "rolloutd.client",
         "controller/integrations": "rolloutd.integrations"}


def package_of(folder: Path) -> str:
    """The package a source folder installs as: the most specific PARTS entry containing it."""
    rel = folder.relative_to(REPO)
    owner = max((f for f in PARTS if rel.parts[:len(Path(f).parts)] == Path(f).parts), key=lambda f: len(Path(f).parts))
    return ".".join([PARTS[owner], *rel.parts[len(Path(owner).parts):]])


def package_of_data(pkg: str) -> list[str]:
    """The folder (parts under the repository) a data-only package names: its PARTS entry + the rest."""
    owner = max((f for f, p in PARTS.items() if pkg == p or pkg.startswith(p + ".")), key=lambda f: len(PARTS[f]))
    return [*Path(owner).parts, *pkg[len(PARTS[owner]):].strip(".").split(".")] if pkg != PARTS[owner] else [owner]


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {pkg: folder for folder, pkg in PARTS.items()}
    listed = set(cfg["packages"])
    found = set()
    for folder in PARTS:
        for init in (REPO / folder).rglob("__init__.py"):
            found.add(package_of(init.parent))
    assert found - listed == set(), f"add these to [tool.setuptools] packages: {sorted(found - listed)}"
    data = set(cfg["package-data"]) - found  # data-only folders, listed so setuptools installs them without a warning
    assert all(REPO.joinpath(*package_of_data(d)).is_dir() for d in data), f"package-data names no folder: {data}"
    assert listed - found - data == set(), f"listed but no such folder: {sorted(listed - found - data)}"


def test_nested_folder_maps_to_its_own_package():
    assert package_of(REPO / "controller" / "client") == "rolloutd.client"
    assert package_of(REPO / "controller" / "executors") == "rolloutd.controller.executors"
    assert package_of(REPO / "controller") == "rolloutd.controller"


def test_trainer_client_imports_only_httpx_and_the_standard_library(tmp_path):
    """A trainer's environment: importing rolloutd.client pulls in no numpy, torch, yaml,
    pydantic or controller machinery."""
    code = ("import sys, httpx; base = set(sys.modules); from rolloutd.client import RolloutClient; "  # httpx may pull in rich
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - base} & {'numpy','torch','yaml','pydantic',"
            "'fastapi','sqlmodel','typer','rich','transformers'})); "
            "print(sorted(m for m in sys.modules if m.startswith('rolloutd.') and not m.startswith('rolloutd.client')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    heavy, ours = out.stdout.splitlines()
    assert heavy == "[]"
    # only the base layer's import-light modules: the back-off kit, documents (YAML errors), names, the failure
    # taxonomy (the client's errors hang off its root), the variable table and the paths it sets (the data dir)
    assert ours == ("['rolloutd.crds', 'rolloutd.crds.errors', 'rolloutd.crds.kit', 'rolloutd.crds.kit.aiokit', "
                    "'rolloutd.crds.kit.documents', 'rolloutd.crds.kit.paths', 'rolloutd.crds.kit.settings', "
                    "'rolloutd.crds.names', 'rolloutd.crds.nodeenv']")


def test_no_bare_top_level_modules_are_importable_outside_the_repo(tmp_path):
    code = ("import importlib.util, sys; "
            "print([m for m in ('controller','sandbox','agents','crds') if importlib.util.find_spec(m)])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    assert importlib.util.find_spec("rolloutd.controller") is not None


def test_console_scripts_run():
    bindir = Path(sys.executable).parent
    for script, expect in (("rolloutd", "controller"), ("rolloutctl", "apply")):
        r = subprocess.run([str(bindir / script), "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and expect in r.stdout, r.stderr


def test_a_controller_and_rolloutctl_import_from_bytecode_not_source():
    """`make setup` compiles the venv and this tree (Makefile's `bytecode`): with PYTHONDONTWRITEBYTECODE set (as on
    CI's machines) nothing else would, and each process compiled every module it imports: a controller's start
    was ~6.5 s instead of ~2 s. Every module a controller and rolloutctl load has its bytecode on disk, up to date."""
    code = ("import importlib.util, os, sys; import rolloutd.controller.server, rolloutd.controller.ctl.app\n"
            "for name, m in list(sys.modules.items()):\n"
            "    f = getattr(m, '__file__', None)\n"
            "    if not f or not f.endswith('.py'): continue\n"
            "    c = importlib.util.cache_from_source(f)\n"
            "    if not os.path.exists(c) or os.path.getmtime(c) < os.path.getmtime(f): print(name)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**env, "PYTHONDONTWRITEBYTECODE": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [], f"imported from source (run `make bytecode`): {r.stdout.split()[:20]}"
