"""Shared pytest configuration. Part-specific fixtures live in tests/<part>/conftest.py."""
