"""Fixtures for the web UI tests: a real controller (local executor, no daemon: the test is the node, over the
real node protocol), two namespaces' jobs with trajectories made with the tiny model's tokenizer, a namespace
token, and Debian's chromium driven headless by selenium (its console log kept for the checks)."""
from __future__ import annotations

import shutil

import httpx
import pytest

from support.controller_process import ControllerProcess
from support.ui_protocol import Cluster

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("ui")
    c = ControllerProcess(base / "data", executors="local").start()
    try:
        yield Cluster(c, base)
    finally:
        c.stop()


@pytest.fixture
def own_cluster(tmp_path):
    """A controller of the test's own (it may restart it)."""
    c = ControllerProcess(tmp_path / "data", executors="local").start()
    try:
        yield Cluster(c, tmp_path)
    finally:
        c.stop()


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        pytest.fail("chromium and chromium-driver are needed (.ci/system-packages.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1360,1000",
                "--disable-gpu", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def api(cluster):
    with httpx.Client(base_url=cluster.controller.url, timeout=30) as client:
        yield client
