"""`bench pipeline`'s stub-LLM job run by two source trees side by side: this one and another (a worktree of main,
with its own `make venv`), one controller each, alternating (ABBA), against one stub backend: a before/after.

    .venv/bin/python -m bench.pipeline_trees /path/to/other/tree [ROUNDS]

Prints one JSON line per job (the `_measure` row of bench_pipeline.py plus the node calls (POST) and the store's
WAL syncs per rollout, read from the controller's /metrics) and the medians per tree. Next step: its numbers go to
bench/results/RESULTS-pipeline.md by hand.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from bench.bench_pipeline import P, REPO, _dataset, _job, _measure, _port, _wait_http, _wait_phase


def _start(tree: Path, data_dir: Path, port: int) -> tuple[subprocess.Popen, httpx.Client]:
    """`tree`'s controller, run by `tree`'s venv (its daemons too: they are started with its interpreter)."""
    env = {**os.environ, "PYTHONPATH": str(tree / "tests/support/sim/plugins")}
    ctl = subprocess.Popen([str(tree / ".venv/bin/python"), "-m", "rolloutd.controller.main", "controller",
                            "--data-dir", str(data_dir), "--port", str(port), "--log-level", "warning"],
                           cwd=tree, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/healthz")
    token = (data_dir / "token").read_text().strip()
    return ctl, httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def _counter(api: httpx.Client, name: str, label: str = "") -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in api.get("/metrics").text.splitlines()
               if line.startswith(name) and label in line)


def run(other: Path, rounds: int, prompts: int = 250, samples: int = 8) -> list[dict]:
    from rolloutd.agents.engine.model_dirs import prepare_model

    n, tmp = prompts * samples, Path(tempfile.mkdtemp(prefix="rolloutd-bench-trees-"))
    tokenizer, source = str(prepare_model("tiny")), _dataset(tmp, prompts)
    port = _port()
    backend = f"http://127.0.0.1:{port}"
    stub = subprocess.Popen([sys.executable, "-m", "bench.stub_backend", "--port", str(port), "--tokenizer",
                             tokenizer], cwd=REPO, start_new_session=True)
    rows = []
    try:
        _wait_http(backend + "/health")
        for r in range(rounds):
            for name, tree in (("this", REPO), ("other", other))[:: 1 if r % 2 == 0 else -1]:
                ctl, api = _start(tree, tmp / f"data-{r}-{name}", _port())
                try:
                    api.put(f"{P}/rolloutjobs/warm", json=_job("warm", source, tokenizer, backend, 2, 2)).raise_for_status()
                    _wait_phase(api, "warm", "Succeeded")
                    posts, syncs = _counter(api, "rolloutd_api_requests_total", 'method="POST"'), \
                        _counter(api, "rolloutd_store_syncs_total")
                    m = _measure(api, ctl.pid, stub.pid, f"b{r}", _job(f"b{r}", source, tokenizer, backend, prompts,
                                                                      samples), n)
                    m.update(tree=name, round=r, load=os.getloadavg()[0],
                             posts=(_counter(api, "rolloutd_api_requests_total", 'method="POST"') - posts) / n,
                             syncs=(_counter(api, "rolloutd_store_syncs_total") - syncs) / n)
                    rows.append(m)
                    print(json.dumps(m), flush=True)
                finally:
                    os.killpg(ctl.pid, signal.SIGTERM)
                    ctl.wait(20)
    finally:
        os.killpg(stub.pid, signal.SIGTERM)
        stub.wait(20)
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


if __name__ == "__main__":
    got = run(Path(sys.argv[1]).resolve(), int(sys.argv[2]) if len(sys.argv) > 2 else 4)
    for name in ("this", "other"):
        mine = [m for m in got if m["tree"] == name]
        print(name, {k: round(statistics.median(m[k] for m in mine), 3)
                     for k in ("sustained", "ctl_ms", "daemons_ms", "stub_ms", "posts", "syncs", "load")})
