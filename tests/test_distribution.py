"""What `pip install rolloutd[...]` brings: the wheel built from this tree, installed into clean venvs, one per
extra, each importing every module it promises — and every third-party import declared where it is used.

The trainer's install (no extra) must stay slim: the client and rolloutctl, no transformers, kopf, fastapi,
ipykernel or sympy. Wheels of the dependencies are downloaded once into `~/.cache/rolloutd/wheelhouse/<hash of
the requirements>` (charts/image/build.py's `wheelhouse()`, which the container image installs from too); the venvs install from there only (`--no-index`), so a missing declaration fails here.
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
HEAVY = {"transformers", "kopf", "fastapi", "ipykernel", "sympy", "torch", "sqlmodel", "jupyter-client"}
# what each extra promises: the packages whose every module imports
PROMISES = {"": ["rolloutd.client", "rolloutd.crds", "rolloutd.controller.ctl"],
            "node": ["rolloutd.agents", "rolloutd.sandbox"],
            "controller": ["rolloutd.controller", "rolloutd.agents", "rolloutd.sandbox"]}
# imported only where an optional part is used, each behind its own extra or a clear error
# (verl, skyrl: the trainers' extras; typing_extensions comes with skyrl; wandb, mlflow: the trackers' extra;
# psycopg: the [postgresql] extra, imported only by a controller whose --store is a postgresql:// URL; requests:
# a dependency of the [tracing] extra's OTLP exporter, imported only beside it to pick its transport)
OPTIONAL = {"torch", "numpy", "seccomp", "spython", "kubernetes", "trl", "datasets", "safetensors",
            "verl", "skyrl", "typing_extensions", "wandb", "mlflow", "opentelemetry", "psycopg", "requests"}


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def declared(extra: str) -> set[str]:
    """Distribution names `pip install rolloutd[extra]` brings directly (extras of rolloutd expanded)."""
    reqs = list(PROJECT["dependencies"]) + (PROJECT["optional-dependencies"].get(extra, []) if extra else [])
    names = set()
    for r in reqs:
        if r.startswith("rolloutd["):
            for inner in r[len("rolloutd["):-1].split(","):
                names |= declared(inner)
        else:
            names.add(_name(r))
    return names


def third_party_imports(folder: Path) -> set[str]:
    std = set(sys.stdlib_module_names) | {"__future__", "rolloutd"}
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
    return found - std


@pytest.mark.parametrize(("folder", "extra", "skip"), [
    ("crds", "", ()), ("controller/client", "", ()), ("agents", "node", ()), ("sandbox", "node", ()),
    ("controller", "controller", ("integrations",))])
def test_every_import_is_declared(folder, extra, skip):
    """Each third-party module a part imports comes from a distribution its extra declares (h11 and aiohttp
    were imported but undeclared, reached only through other packages' dependencies)."""
    dists = md.packages_distributions()
    missing = {}
    for module in third_party_imports(REPO / folder) - OPTIONAL:
        if any(s in module for s in skip):
            continue
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        if not names & declared(extra):
            missing[module] = sorted(names)
    assert not missing, f"{folder} imports modules no requirement of {extra or 'the base install'} declares: {missing}"


def _image_build():
    """charts/image/build.py, whose wheelhouse (every extra's dependency wheels, downloaded once) the image uses too."""
    spec = importlib.util.spec_from_file_location("image_build", REPO / "charts" / "image" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path]:
    image_build = _image_build()
    return image_build.build_wheel(tmp_path_factory.mktemp("wheel")), image_build.wheelhouse()


def _install(tmp_path: Path, wheel: Path, house: Path, extra: str) -> Path:
    env_dir = tmp_path / f"venv-{extra or 'base'}"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    target = f"{wheel}[{extra}]" if extra else str(wheel)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-compile", "--no-index", "--find-links", str(house), target],
                   check=True, timeout=600)
    return py


IMPORT_ALL = """
import importlib, pkgutil, sys
failed = []
for name in sys.argv[1:]:
    mod = importlib.import_module(name)
    for info in pkgutil.walk_packages(getattr(mod, "__path__", []), name + "."):
        try:
            importlib.import_module(info.name)
        except Exception as e:
            failed.append(f"{info.name}: {e!r}")
print("\\n".join(failed))
"""


@pytest.mark.parametrize("extra", ["", "node", "controller"])
def test_each_extra_installs_into_a_clean_venv_and_imports_what_it_promises(built, tmp_path, extra):
    wheel, house = built
    py = _install(tmp_path, wheel, house, extra)
    done = subprocess.run([str(py), "-c", IMPORT_ALL, *PROMISES[extra]], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    have = {d.metadata["Name"].lower().replace("_", "-") for d in md.distributions(path=[
        str(p) for p in (py.parent.parent / "lib").glob("python3*/site-packages")])}
    if not extra:
        assert not have & HEAVY, f"the base install pulls in {sorted(have & HEAVY)}"
        help_ = subprocess.run([str(py.parent / "rolloutctl"), "--help"], capture_output=True, text=True)
        assert help_.returncode == 0 and "apply" in help_.stdout
        refused = subprocess.run([str(py.parent / "rolloutd"), "controller", "--data-dir", str(tmp_path / "d")],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "rolloutd[controller]" in refused.stderr
        assert "Traceback" not in refused.stderr
