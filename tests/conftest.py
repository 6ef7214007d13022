"""Shared pytest configuration. Part-specific fixtures live in tests/<part>/conftest.py.

pytest imports test modules with --import-mode=importlib, so this folder is put on sys.path for the
helpers every part shares (`waiting`)."""
import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
