"""The chart's Grafana dashboard (charts/rolloutd/dashboards/rolloutd.json) against a real controller's /metrics:
every series a panel queries is one the controller serves, every rolloutd family it serves has a panel, and the
chart ships the file unchanged in the ConfigMap Grafana's sidecar loads (off by default)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from support.controller_process import ControllerProcess
from support.kube_tools import helm

CHART = Path(__file__).resolve().parents[2] / "charts" / "rolloutd"
DASHBOARD = json.loads((CHART / "dashboards" / "rolloutd.json").read_text())
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def queried() -> set[str]:
    """The metric names in the panels' expressions, histogram and counter suffixes taken off."""
    names = set()
    for panel in DASHBOARD["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\brolloutd_[a-z0-9_]+", target["expr"]):
                names.add(next((name[:-len(s)] for s in SUFFIXES if name.endswith(s)), name))
    return names


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> set[str]:
    c = ControllerProcess(tmp_path_factory.mktemp("dashboard") / "data").start()
    try:
        with c.client() as api:
            api.get("/apis/rolloutd.io/v1alpha1/rolloutjobs")   # a request, so the request series exist
            text = api.get("/metrics").text
    finally:
        c.stop()
    # the parser reads a counter's or histogram's `_created` sample as a family of its own: a timestamp, not charted
    return {f.name for f in text_string_to_metric_families(text)
            if f.name.startswith("rolloutd_") and not f.name.endswith("_created")}


def test_every_panel_queries_a_served_metric(served):
    assert queried() and not queried() - served, f"the dashboard queries what /metrics lacks: {queried() - served}"


def test_every_served_family_has_a_panel(served):
    assert not served - queried(), f"families /metrics serves that no panel shows: {served - queried()}"


def test_the_chart_ships_the_dashboard_when_asked():
    def render(values: dict) -> list[dict]:
        out = subprocess.run([helm(), "template", "r", str(CHART), "-n", "rl", "-f", "-"],
                             input=yaml.safe_dump(values), capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "ConfigMap"]

    assert not render({})
    (cm,) = render({"grafanaDashboard": {"enabled": True}})
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["rolloutd.json"]) == DASHBOARD
