"""Stalls: team-b's GET latency while team-a does its worst legal thing, beside an idle window, in one run.

    python -m bench stalls           (writes bench/results/RESULTS-stalls.md; --quick: smaller loads)

One real `rolloutd controller` (`bench_scale.Controller`: nothing starts, 0 nodes). team-b GETs its own job in
a loop with its namespace token, four windows one after the other: idle; while a batch of many groups is
requested on a batch job (`batch`); while YAML alias bombs are POSTed in a loop (`bombs`); while many
connections are held open without sending a request head (`half-open`). Reported per window: team-b's GET
p50/p99/max and the ratio of its p99 to the idle one (goal of issue 36: within 2×), and the same of team-b's node
heartbeat (one registered node of its job, the beat in turn with the GET). The setup is `teams.py`'s.
`$ROLLOUTD_STALLS_BEFORE=REV` (e.g. main) measures that revision's controller first in the same run, and the
results file shows both tables (side by side on the same loaded box).
"""
from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.bench_scale import P, older_source
from bench.teams import job, two_teams

HERE = Path(__file__).resolve().parent
BOMB = ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))).encode()
# team-a's bomber is a process of its own, as a hostile tenant is: in the bench's process its loop would hold
# the GIL that team-b's probe needs, and the window would measure the bench, not the controller
_BOMBER = """
import sys, httpx
url, token, path, bomb = sys.argv[1:5]
with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}", "Content-Type": "application/yaml"}) as a:
    while True:
        a.post(path, content=bomb.encode())
"""


def measure(groups: int, seconds: float, half_open: int, src: Path | None = None) -> dict:
    with two_teams(64, "bench-stalls-", src) as t:
        ctl = t.ctl
        big = job("big", t.source, 64, 8, t.health.urls)
        big["spec"]["batches"] = {"groups": groups}
        ctl.api.post(f"{P}/namespaces/team-a/rolloutjobs", json=big).raise_for_status()

        def batch(stop: threading.Event) -> None:
            ctl.api.post(f"{P}/namespaces/team-a/rolloutjobs/big/batches", json={}).raise_for_status()

        def bombs(stop: threading.Event) -> None:
            bomber = subprocess.Popen([sys.executable, "-c", _BOMBER, ctl.url, ctl.token,
                                       f"{P}/namespaces/team-a/rolloutjobs", BOMB.decode()])
            try:
                stop.wait()
            finally:
                bomber.kill()
                bomber.wait()

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

        out = {"idle": t.window(seconds, None)}
        t0 = time.monotonic()
        out["batch"] = t.window(seconds, batch)
        out["batch_s"] = time.monotonic() - t0
        out["bombs"] = t.window(seconds, bombs)
        out["half-open"] = t.window(seconds, hold)
    return out


def _table(m: dict, names: dict) -> str:
    rows = []
    for k in names:
        cells = []
        for kind in ("get", "beat"):
            x, idle = m[k][kind], m["idle"][kind]["p99"]
            cells.append(f"{x['n']} | {x['p50']:.1f} | {x['p99']:.1f} | {x['max']:.1f} | {x['p99'] / idle:.2f}×")
        rows.append(f"| {names[k]} | {' | '.join(cells)} |\n")
    return ("| team-b while | GET n | p50 ms | p99 ms | max ms | p99 / idle | beat n | p50 ms | p99 ms | max ms | "
            "p99 / idle |\n|---|---|---|---|---|---|---|---|---|---|---|\n" + "".join(rows))


def run(quick: bool = False) -> list[dict]:
    """`$ROLLOUTD_STALLS_BEFORE=REV`: that revision's controller is measured first, in the same run (side by side)."""
    groups, seconds, half_open = (500, 4.0, 300) if quick else (2000, 8.0, 1000)
    before_rev = os.environ.get("ROLLOUTD_STALLS_BEFORE")
    before = None
    if before_rev:
        with older_source(before_rev) as src:
            before = measure(groups, seconds, half_open, src)
    load0 = os.getloadavg()[0]
    m = measure(groups, seconds, half_open)
    names = {"idle": "idle", "batch": f"a batch of {groups} groups × 8 requested (admin's job: no item quota)",
             "bombs": "YAML alias bombs POSTed in a loop", "half-open": f"{half_open} connections with half a head"}
    table = _table(m, names)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    if not quick:
        side = "" if before is None else (
            f"\nThe controller of `{before_rev}`, measured just before in the same run (the batch took "
            f"{before['batch_s']:.1f} s to open there, {m['batch_s']:.1f} s here):\n\n{_table(before, names)}")
        (HERE / "results" / "RESULTS-stalls.md").write_text(
            f"# Stalls (issue 36)\n\n`python -m bench stalls` on {platform.node()} ({platform.machine()}, "
            f"{os.cpu_count()} cores, shared with other jobs, load {load0:.1f}→{os.getloadavg()[0]:.1f}), {stamp}. "
            f"Windows of {seconds:.0f} s each, one after the other, in one run; team-b's GET of its job and its "
            f"node's heartbeat in turn.\n\n{table}{side}\nGoal: team-b's p99 within 2× of idle in each window.\n")
    return [{"benchmark": f"stalls: team-b {kind} p99 while team-a {names[k]}", "ours": f"{m[k][kind]['p99']:.1f} ms",
             "baseline": f"{m['idle'][kind]['p99']:.1f} ms idle",
             "ratio": m[k][kind]["p99"] / m["idle"][kind]["p99"], "target": "≤ 2×",
             "met": m[k][kind]["p99"] <= 2 * m["idle"][kind]["p99"]}
            for k in ("batch", "bombs", "half-open") for kind in ("get", "beat")]


if __name__ == "__main__":
    print(run())
