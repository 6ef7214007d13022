"""tests/tasks: run from the repository root so the shipped examples/ paths resolve."""
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _repo_root_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)
    yield
