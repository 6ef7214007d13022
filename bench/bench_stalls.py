"""Stalls: team-b's GET latency while team-a does its worst legal thing, beside an idle window, in one run.

    python -m bench stalls           (writes bench/results/RESULTS-stalls.md; --quick: smaller loads)

One real `rolloutd controller` (`bench_scale.Controller`: nothing starts, 0 nodes). team-b GETs its own job in
a loop with its namespace token, four windows one after the other: idle; while a batch of many groups is
requested on a batch job (`batch`); while YAML alias bombs are POSTed in a loop (`bombs`); while many
connections are held open without sending a request head (`half-open`). Reported per window: team-b's GET
p50/p99/max and the ratio of its p99 to the idle one (goal of issue 36: within 2×). Node-beat latency is not
measured here (`bench_scale.py` measures beats).
"""
from __future__ import annotations

import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.bench_scale import P, Controller, HealthServer, _pct
from bench.bench_tenancy import _gets
from bench.bench_tenancy import _job as _tenancy_job
from rolloutd.controller.auth import create_scoped_token

HERE = Path(__file__).resolve().parent
BOMB = ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))).encode()


def _job(name: str, source: Path, prompts: int, samples: int, backends: list[str]) -> dict:
    doc = _tenancy_job(name, source, prompts, samples, backends)
    doc["spec"]["llm"]["tokenizer"] = str(source.parent)  # beneath ROLLOUTD_TOKENIZER_ROOTS (`Controller`)
    return doc


def _summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": statistics.median(xs), "p99": _pct(xs, 0.99), "max": max(xs)}


def _window(client: httpx.Client, path: str, seconds: float, load) -> dict:
    """team-b's GETs for `seconds` while `load(stop)` runs in another thread (None: idle)."""
    out: list[float] = []
    stop = threading.Event()
    worker = threading.Thread(target=load, args=(stop,)) if load else None
    if worker:
        worker.start()
    _gets(client, path, threading.Event(), out, seconds)
    stop.set()
    if worker:
        worker.join()
    return _summary(out)


def measure(groups: int, seconds: float, half_open: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-stalls-") as tmp:
        root = Path(tmp)
        source = root / "rows.jsonl"
        source.write_text("".join(f'{{"id":"r{i}"}}\n' for i in range(64)))
        health = HealthServer()
        ctl = Controller(root)
        try:
            team_b = create_scoped_token(root / "data" / "tokens", "team-b", read_only=False, namespaces=["team-b"])
            ctl.api.post(f"{P}/namespaces/team-b/rolloutjobs", json=_job("small", source, 4, 1, health.urls[:1])
                         ).raise_for_status()
            big = _job("big", source, 64, 8, health.urls)
            big["spec"]["batches"] = {"groups": groups}
            ctl.api.post(f"{P}/namespaces/team-a/rolloutjobs", json=big).raise_for_status()
            mine = f"{P}/namespaces/team-b/rolloutjobs/small"

            def batch(stop: threading.Event) -> None:
                ctl.api.post(f"{P}/namespaces/team-a/rolloutjobs/big/batches", json={}).raise_for_status()

            def bombs(stop: threading.Event) -> None:
                with httpx.Client(base_url=ctl.url, headers={"Authorization": f"Bearer {ctl.token}",
                                                             "Content-Type": "application/yaml"}) as a:
                    while not stop.is_set():
                        a.post(f"{P}/namespaces/team-a/rolloutjobs", content=BOMB)

            def hold(stop: threading.Event) -> None:
                socks = []
                try:
                    for _ in range(half_open):
                        socks.append(socket.create_connection(("127.0.0.1", ctl.port)))
                        socks[-1].sendall(b"GET /healthz HTTP/1.1\r\n")
                    stop.wait()
                finally:
                    for s in socks:
                        s.close()

            with httpx.Client(base_url=ctl.url, headers={"Authorization": f"Bearer {team_b.token}"},
                              timeout=120) as b:
                for _ in range(20):
                    b.get(mine).raise_for_status()
                out = {"idle": _window(b, mine, seconds, None)}
                t0 = time.monotonic()
                out["batch"] = _window(b, mine, seconds, batch)
                out["batch_s"] = time.monotonic() - t0
                out["bombs"] = _window(b, mine, seconds, bombs)
                out["half-open"] = _window(b, mine, seconds, hold)
        finally:
            ctl.stop()
            health.close()
    return out


def run(quick: bool = False) -> list[dict]:
    groups, seconds, half_open = (500, 4.0, 300) if quick else (2000, 8.0, 1000)
    m = measure(groups, seconds, half_open)
    idle = m["idle"]["p99"]
    names = {"idle": "idle", "batch": f"a batch of {groups} groups × 8 requested (admin's job: no item quota)",
             "bombs": "YAML alias bombs POSTed in a loop", "half-open": f"{half_open} connections with half a head"}
    table = "| team-b GET while | n | p50 ms | p99 ms | max ms | p99 / idle |\n|---|---|---|---|---|---|\n" + "".join(
        f"| {names[k]} | {m[k]['n']} | {m[k]['p50']:.1f} | {m[k]['p99']:.1f} | {m[k]['max']:.1f} | "
        f"{m[k]['p99'] / idle:.2f}× |\n" for k in names)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if not quick:
        (HERE / "results" / "RESULTS-stalls.md").write_text(
            f"# Stalls (issue 36)\n\n`python -m bench stalls` on {platform.node()} ({platform.machine()}, "
            f"{os.cpu_count()} cores, shared with other jobs), {stamp}. Windows of {seconds:.0f} s each, one after "
            f"the other, in one run.\n\n{table}\nGoal: team-b's p99 within 2× of idle in each window.\n")
    return [{"benchmark": f"stalls: team-b GET p99 while team-a {names[k]}", "ours": f"{m[k]['p99']:.1f} ms",
             "baseline": f"{idle:.1f} ms idle", "ratio": m[k]["p99"] / idle if idle else None, "target": "≤ 2×",
             "met": m[k]["p99"] <= 2 * idle} for k in ("batch", "bombs", "half-open")]


if __name__ == "__main__":
    print(run())
