"""The RL example's tests: the trainer runs in the engine venv (torch), so they drive it as a
subprocess; the engine is the shared tiny one (tests/engine_fixtures.py)."""
from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for _p in (_TESTS, _TESTS / "e2e"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from engine_fixtures import engine_pool, tiny_engine  # noqa: E402,F401
