"""Fixtures for the controller tests: a real `rolloutd controller` process on a free port.

These tests exercise the API and CLI mechanics, so the controller runs with no executor
(`--executors ''`): jobs stay Pending with an ExecutorUnavailable condition and no daemon
is started. The end-to-end tests (tests/e2e) run the real executors."""
from __future__ import annotations

import pytest

from support.controller_process import ControllerProcess


@pytest.fixture
def controller(tmp_path):
    c = ControllerProcess(tmp_path / "data").start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def shared_controller(tmp_path_factory):
    """One controller for tests that write nothing lasting (bad input, auth)."""
    c = ControllerProcess(tmp_path_factory.mktemp("shared") / "data").start()
    yield c
    c.stop()


@pytest.fixture
def bad_api(shared_controller):
    with shared_controller.client() as client:
        yield client


@pytest.fixture
def api(controller):
    with controller.client() as client:
        yield client


@pytest.fixture
def example_yaml() -> str:
    """The example job as `rolloutctl apply -f` sends it (relative paths resolved: the API refuses them)."""
    from support.example_job import example_yaml

    return example_yaml()
