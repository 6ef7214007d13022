"""Tracing is off unless `ROLLOUTD_TRACING` asks for it: the controller's and the node's modules import nothing of
the OpenTelemetry SDK or exporter (FastAPI itself imports the API), every span helper is a no-op; turned on without the SDK, the error names the extra to install."""
from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import sys
from rolloutd.crds.kit import trace_spans, tracing
from rolloutd.agents import spans
import rolloutd.agents.daemon.daemon, rolloutd.agents.gateway.server, rolloutd.controller.server
from rolloutd.crds import nodeenv
from rolloutd.crds.kit.settings import ControllerSettings
on = nodeenv.read_node_env({}).tracing or nodeenv.tracing_on(ControllerSettings.from_env({}).tracing)
assert not tracing.setup("probe", on) and not tracing.enabled()
assert nodeenv.read_node_env({"ROLLOUTD_TRACING": "1"}).tracing
assert nodeenv.tracing_on(ControllerSettings.from_env({"ROLLOUTD_TRACING": "1"}).tracing)
with trace_spans.span("x", {"a": 1}) as s:
    s.set_attribute("b", 2)
assert trace_spans.traceparent() is None and tracing.trace_id() is None
from rolloutd.controller.work import tracing as ctl
grant = dict(attempt_id="1.1.x", item=1, prompt=0, sample=0, attempt=1, backend=None, queued_seconds=0.0)
assert ctl.granted(grant, "default/j", "n") is None and ctl.trace_id("1.1.x") is None
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))))
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "ROLLOUTD_TRACING"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**clean, **env},
                          timeout=120)


def test_off_by_default_nothing_of_opentelemetry_is_imported():
    r = _run(PROBE)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_on_without_the_sdk_names_the_extra():
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from rolloutd.crds.kit import tracing\n"
            "try:\n    tracing.setup('probe', True)\nexcept ImportError as e:\n    print(e)\n")
    r = _run(code, ROLLOUTD_TRACING="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rolloutd[tracing]" in r.stdout
