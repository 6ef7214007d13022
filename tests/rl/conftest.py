"""The RL example's tests: the trainer runs in the engine venv (torch), so they drive it as a
subprocess; the engine is the shared tiny one (tests/support/engine_fixtures.py)."""
from __future__ import annotations

from support.engine_fixtures import engine_pool, tiny_engine  # noqa: F401
