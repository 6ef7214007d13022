"""Jobs and checks shared by the verl and SkyRL adapter tests (tests/rl): a batch job of scripted rewards on the
tiny engine whose last prompt's sample 1 always fails on infrastructure, and the trainers' venvs."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from .cluster import job_doc

HOME = Path(os.environ.get("ROLLOUTD_HOME") or Path.home() / ".cache" / "rolloutd")
REPO = Path(__file__).resolve().parents[2]


def trainer_python(name: str, *packages: str) -> tuple[Path, str]:
    """The trainer venv's python, and why it cannot be used ("" when it can): the packages must be installed
    there (found, not imported: importing verl or skyrl takes ~15 s, the test's own script does it)."""
    py = HOME / name / "venv" / "bin" / "python"
    if not py.exists():
        return py, f"no {name} venv at {py} (`make {name}-venv`, part of `make setup`, creates it)"
    check = f"import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in {list(packages)!r}))"
    r = subprocess.run([str(py), "-c", check], capture_output=True, text=True)
    if r.returncode:
        return py, f"the {name} venv {py} lacks one of {packages}: {r.stderr[-300:]}"
    # the venv is shared by checkouts: its editable rolloutd must be this one (as examples/trl/train_trl.py does)
    where = "import importlib.util as u; print(u.find_spec('rolloutd.integrations').submodule_search_locations[0])"
    found = subprocess.run([str(py), "-c", where], capture_output=True, text=True).stdout.strip()
    if not found or not Path(found).resolve().is_relative_to(REPO):
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "-e",
                        str(REPO)], check=True, capture_output=True)
    return py, ""


def scripted_job(cluster, engine, name: str, root: Path, *, prompts: int = 2, samples: int = 2,
                 backends: list[str] | None = None) -> Path:
    """Apply the batch job; return its dataset. Rewards: sample % 2 ("mixed"); the last prompt's sample 1 fails
    in RUN as an infrastructure failure, every time (one attempt)."""
    rows = [{"id": f"{name}-{i}", "question": f"What is {i} + 1?", "answer": str(i + 1), "script": "mixed"}
            for i in range(prompts)]
    rows[-1]["infraSample"] = 1
    source = root / f"{name}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = job_doc(name, engine, kind="scripted", source=str(source), limit=prompts, samples=samples, tools=(),
                  max_turns=1, tokens=8, max_attempts=1, backends=backends)
    doc["spec"]["batches"] = {"groups": prompts}
    cluster.apply(doc)
    return source


def stored(cluster, name: str) -> dict[tuple, dict[str, Any]]:
    """The job's stored trajectories by (prompt, group, sample)."""
    return {(t["prompt"], t.get("group"), t["sample"]): t for t in cluster.trajectories(name)}


def env_without_venv() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
