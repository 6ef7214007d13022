"""A job that runs no model: the `bench-noop` task kind (its plug-in in `tests/support/sim/plugins/`, found through the
dist-info on a daemon's PYTHONPATH) against LLM backends that only answer the controller's health checks.

Used by the scale, operator and tenancy benches and by tests that need a real job to finish without an
engine (tests/controller/kube/test_tls.py). Next step: a backend that also generates, for jobs with a real task kind."""
from __future__ import annotations

import http.server
import threading
from pathlib import Path

NOOP = "bench-noop"  # the task kind of tests/support/sim/plugins/bench_noop_task.py
PLUGINS = Path(__file__).resolve().parent / "plugins"  # put on a daemon's PYTHONPATH to load it
BACKENDS = 4
SLOTS = 64


class HealthServer:
    """Answers 200 to `GET …/health`: the job's LLM backends (`/b0` … `/b3`) for the controller's health
    checks. Nobody generates anything (the task is a no-op), but leases pin a backend from the min-heap
    and beats release it, as in production."""

    def __init__(self) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                self.send_response(200 if self.path.endswith("/health") else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.urls = [f"http://127.0.0.1:{self.server.server_address[1]}/b{i}" for i in range(BACKENDS)]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def noop_job(name: str, source: Path, items: int, backends: list[str]) -> dict:
    """A RolloutJob of `items` no-op rollouts (8 samples a prompt of `source`) for simulated daemons
    (`nodes: 0`, `SLOTS` workers a stage)."""
    return {
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
        "spec": {
            "tasks": {"kind": NOOP, "source": str(source), "limit": items // 8},
            "samplesPerPrompt": 8,
            "agent": {"maxTurns": 1, "tools": []},
            # a directory (tokenizers load offline only, absolute paths): the simulated daemons load none
            "llm": {"tokenizer": str(source.parent), "backends": [{"url": u} for u in backends]},
            "executor": {"kind": "local", "nodes": 0},  # the simulated daemons register on their own
            "pipeline": {"workersPerNode": {"init": SLOTS, "run": SLOTS, "eval": SLOTS}},
        },
    }
