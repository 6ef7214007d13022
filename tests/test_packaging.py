"""The distribution installs one namespace (`rolloutd.*`) covering every source folder."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = {"crds": "rolloutd.crds", "controller": "rolloutd.controller", "agents": "rolloutd.agents",
         "sandbox": "rolloutd.sandbox"}


def test_every_package_folder_is_listed():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert cfg["package-dir"] == {pkg: folder for folder, pkg in PARTS.items()}
    listed = set(cfg["packages"])
    found = set()
    for folder, pkg in PARTS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found - listed == set(), f"add these to [tool.setuptools] packages: {sorted(found - listed)}"


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


def test_imports_flow_one_way():
    """crds ← sandbox ← agents ← controller: a lower part never imports a higher one."""
    order = ["crds", "sandbox", "agents", "controller"]
    bad = []
    for i, part in enumerate(order):
        higher = order[i + 1:]
        for path in (REPO / part).rglob("*.py"):
            text = path.read_text()
            for h in higher:
                if f"rolloutd.{h}" in text and "import" in text:
                    for line in text.splitlines():
                        s = line.strip()
                        if s.startswith(("import ", "from ")) and f"rolloutd.{h}" in s:
                            bad.append(f"{path.relative_to(REPO)}: {s}")
    assert bad == []
