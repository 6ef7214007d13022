"""Controller API cost: a RolloutJob apply through the real HTTP API (uvicorn + auth + validation
+ SQLite WAL) against the same apply straight into the store, side by side in one run.

The ratio is the price of the API layer; the absolute rate says how many apply/s one
controller sustains on this machine.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(quick: bool = False) -> list[dict]:
    from rolloutd.controller.store import Store
    from rolloutd.crds.rolloutjob import RolloutJob

    n = 100 if quick else 400
    base = yaml.safe_load((REPO / "examples" / "math-demo.yaml").read_text())
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-"))

    # direct store
    store = Store(tmp / "direct.db")
    lat_direct = []
    for i in range(n):
        base["metadata"]["name"] = f"job-{i}"
        job = RolloutJob.model_validate(base)
        t = time.perf_counter()
        store.apply(job)
        lat_direct.append(time.perf_counter() - t)

    # through the API
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir",
                             str(tmp / "api"), "--port", str(port), "--log-level", "warning",
                             "--executors", ""],  # measure the API and store, not 800 daemons
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                httpx.get(url + "/healthz", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        token = (tmp / "api" / "token").read_text().strip()
        lat_api = []
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
            for i in range(n):
                base["metadata"]["name"] = f"job-{i}"
                t = time.perf_counter()
                r = c.put(f"/apis/rolloutd.io/v1alpha1/rolloutjobs/job-{i}", json=base)
                lat_api.append(time.perf_counter() - t)
                r.raise_for_status()
    finally:
        proc.terminate()
        proc.wait(10)

    med_api, med_direct = statistics.median(lat_api), statistics.median(lat_direct)
    p95 = sorted(lat_api)[int(0.95 * len(lat_api)) - 1]
    return [{
        "benchmark": f"RolloutJob apply (create), {n} jobs",
        "ours": f"API p50 {med_api * 1e3:.2f} ms, p95 {p95 * 1e3:.2f} ms ({1 / med_api:.0f}/s)",
        "baseline": f"store only p50 {med_direct * 1e3:.2f} ms",
        "ratio": med_api / med_direct,
        "target": "API p50 ≤ 20 ms",
        "met": med_api <= 0.020,
    }]


if __name__ == "__main__":
    from bench.__main__ import render

    print(render(run()))
