"""A real OTLP receiver for the tracing tests: an MLflow tracking server (MLflow 3 serves OTLP/HTTP at `/v1/traces`,
mlflow/server/otel_api.py) from the trainer's venv, and the spans it stored, read back through MLflow's own client.

Used by tests/e2e/test_tracing.py. Skips when the trainer venv has no mlflow (`make trl-venv` installs it).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
from support.ports import free_port

TRL_PY = Path(os.environ.get("ROLLOUTD_HOME") or Path.home() / ".cache" / "rolloutd") / "trl" / "venv" / "bin" / "python"
EXPERIMENT = "0"   # the Default experiment every fresh MLflow store has

_READ = """
import json, sys, mlflow
mlflow.set_tracking_uri(sys.argv[1])
out = []
for tr in mlflow.search_traces(locations=[sys.argv[2]], return_type="list", max_results=1000):
    for s in tr.data.spans:
        out.append({"trace": tr.info.trace_id, "name": s.name, "span_id": s.span_id, "parent_id": s.parent_id,
                    "start": s.start_time_ns, "end": s.end_time_ns, "attributes": s.attributes})
print(json.dumps(out, default=str))
"""


class Receiver:
    def __init__(self, url: str, proc: subprocess.Popen, log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def ready(self) -> str:
        """Wait until the server answers (2 minutes at most); its URL."""
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self.url
            assert time.monotonic() < deadline, "the MLflow server did not start"
            time.sleep(0.2)


@contextlib.contextmanager
def mlflow_receiver(tmp: Path) -> Iterator[Receiver]:
    """An MLflow server on loopback (its store in `tmp`), starting: `ready()` waits for it; stopped (its process
    group) after."""
    probe = subprocess.run([str(TRL_PY), "-c", "import mlflow.server.otel_api"], capture_output=True, text=True) \
        if TRL_PY.exists() else None
    if probe is None or probe.returncode != 0:
        pytest.skip(f"the trainer venv {TRL_PY} lacks mlflow (`make trl-venv` installs it)")
    port = free_port()
    proc = subprocess.Popen([str(TRL_PY), "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
                             "--artifacts-destination", str(tmp / "artifacts"), "--workers", "1"],
                            stdout=open(tmp / "mlflow.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield Receiver(f"http://127.0.0.1:{port}", proc, tmp / "mlflow.log")
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


def otlp_env(url: str) -> dict[str, str]:
    """The environment that turns tracing on and points the standard OTLP variables at the receiver."""
    return {"ROLLOUTD_TRACING": "1", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{url}/v1/traces",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"x-mlflow-experiment-id={EXPERIMENT}",
            "OTEL_BSP_SCHEDULE_DELAY": "200"}


def stored_spans(url: str) -> list[dict[str, Any]]:
    """Every span the receiver stored, with its MLflow trace id."""
    r = subprocess.run([str(TRL_PY), "-c", _READ, url, EXPERIMENT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
