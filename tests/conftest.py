"""Shared pytest configuration. Part-specific fixtures live in tests/<part>/conftest.py.

pytest imports test modules with --import-mode=importlib; the helpers every part shares are the package
tests/support (`from support.waiting import wait_until`), importable because pyproject's pytest settings
put tests/ on sys.path (`pythonpath`). tests/README.md says where a test goes."""
