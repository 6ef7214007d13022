"""`bench scale` with dashboards open: the UI costs the node hot path nothing (issue 27).

Runs one `bench_scale.point` twice on the same machine, one after the other: without dashboards, then with
`$ROLLOUTD_UI_DASHBOARDS` (default 4) browsers' worth of clients on the job page for the whole run, each logged in
through `POST /ui/login` (a session cookie, as a browser) and doing what the page does: following the job's
server-sent events (`/ui/api/jobs/default/{job}/stream`) and fetching the job page's JSON every second.
Reported for both: p99 of the node calls (lease, beat, results) and rollouts/s over the window; for the
dashboards: the job page JSON's p50/p99 and the SSE documents received.

    ROLLOUTD_SCALE_NICE=-10 ROLLOUTD_UI_NODES=1000 ROLLOUTD_UI_WINDOW=60 python -m bench ui_live
(`$ROLLOUTD_UI_REPEATS` runs of each, interleaved, medians reported; `$ROLLOUTD_UI_BEFORE=REV` adds that revision's
controller with the dashboards, side by side) writes the section "With dashboards open" of bench/results/RESULTS-ui.md (bench_ui.py keeps it) and
bench/results/scale-results/ui-live.json. Next step: a real chromium as one of the dashboards.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.bench_scale import _pct, older_source, point

HERE = Path(__file__).resolve().parent
MARKER = "\n## With dashboards open"


class Dashboards:
    """`n` logged-in clients on one job's page, each an SSE follower and a once-a-second poller (threads)."""

    def __init__(self, url: str, token: str, job: str, n: int) -> None:
        self.stop_ev = threading.Event()
        self.polls: list[tuple[float, float, int]] = []  # (start, seconds, status)
        self.events: list[float] = []  # arrival of each SSE document
        self.errors: list[str] = []
        self.base = f"/ui/api/jobs/default/{job}"
        self.clients = []
        for _ in range(n):
            c = httpx.Client(base_url=url, timeout=30)
            r = c.post("/ui/login", data={"token": token}, follow_redirects=False)
            assert r.status_code == 303 and "rolloutd_session" in c.cookies, r.text
            self.clients.append(c)
        self.threads = [threading.Thread(target=f, args=(c,), daemon=True)
                        for c in self.clients for f in (self._follow, self._poll)]
        for t in self.threads:
            t.start()

    def _follow(self, c: httpx.Client) -> None:
        while not self.stop_ev.is_set():
            try:
                with c.stream("GET", self.base + "/stream", timeout=httpx.Timeout(30, read=30)) as r:
                    for line in r.iter_lines():
                        if self.stop_ev.is_set():
                            return
                        if line.startswith("data: "):
                            self.events.append(time.time())
            except Exception as e:  # noqa: BLE001 - closed under it (the end), or a failed call (counted)
                if self.stop_ev.is_set():
                    return
                self.errors.append(f"stream: {type(e).__name__}")
                self.stop_ev.wait(1.0)

    def _poll(self, c: httpx.Client) -> None:
        while not self.stop_ev.is_set():
            t0 = time.time()
            try:
                status = c.get(self.base).status_code
            except Exception as e:  # noqa: BLE001 - as in _follow
                if self.stop_ev.is_set():
                    return
                self.errors.append(f"poll: {type(e).__name__}")
                status = 0
            self.polls.append((t0, time.time() - t0, status))
            self.stop_ev.wait(max(0.0, 1.0 - (time.time() - t0)))

    def report(self, w0: float, w1: float) -> dict:
        took = [d * 1e3 for t, d, s in self.polls if w0 <= t < w1]
        return {"clients": len(self.clients), "job_json_calls": len(took),
                "job_json_p50_ms": round(_pct(took, 0.5), 1), "job_json_p99_ms": round(_pct(took, 0.99), 1),
                "non_200": sum(1 for t, _, s in self.polls if w0 <= t < w1 and s != 200),
                "sse_documents": sum(1 for t in self.events if w0 <= t < w1), "errors": self.errors[:5]}

    def close(self) -> None:
        self.stop_ev.set()
        for c in self.clients:
            c.close()


def _median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2 if xs else float("nan")


def run(quick: bool = False) -> list[dict]:
    nodes = int(os.environ.get("ROLLOUTD_UI_NODES", "100" if quick else "1000"))
    window = float(os.environ.get("ROLLOUTD_UI_WINDOW", "15" if quick else "60"))
    n = int(os.environ.get("ROLLOUTD_UI_DASHBOARDS", "4"))
    repeats = int(os.environ.get("ROLLOUTD_UI_REPEATS", "1"))
    before = os.environ.get("ROLLOUTD_UI_BEFORE")  # a git revision: its controller with the dashboards too
    points = []
    with contextlib.ExitStack() as stack:
        configs = [("this tree", None, 0), ("this tree", None, n)]
        if before:
            configs.append((before, stack.enter_context(older_source(before)), n))
        for r in range(repeats):  # interleaved: a change of the machine's load falls on every configuration
            for code, src, dash in configs:
                watch = (lambda url, token, job, dash=dash: Dashboards(url, token, job, dash)) if dash else None
                p = point(nodes, 1.0, window, src=src, variant=f"{dash} dashboards, {code}", watch=watch)
                p["repeat"] = r
                points.append(p)
                print(f"   N={nodes} {p['variant']} #{r}: {p['rollouts_per_s']}/s, p99 {p['p99_ms']}, "
                      f"dashboards {p.get('dashboards')}, load {p['load_avg']}", flush=True)
    command = (f"ROLLOUTD_SCALE_NICE=-10 ROLLOUTD_UI_NODES={nodes} ROLLOUTD_UI_WINDOW={window:.0f} "
               f"ROLLOUTD_UI_DASHBOARDS={n} ROLLOUTD_UI_REPEATS={repeats}"
               + (f" ROLLOUTD_UI_BEFORE={before}" if before else "") + " python -m bench ui_live")
    (HERE / "results" / "scale-results").mkdir(exist_ok=True)
    (HERE / "results" / "scale-results" / "ui-live.json").write_text(json.dumps({"command": command, "points": points}, indent=1))
    return write_results(points, command)


def write_results(points: list[dict], command: str) -> list[dict]:
    """The section of RESULTS-ui.md for `points` (one or more runs' raw points together); the bench's rows."""
    nodes, window = points[0]["nodes"], points[0]["window_s"]
    rows, lines, medians = [], [], []
    for p in points:
        p99, d = p["p99_ms"], p.get("dashboards")
        seen = (f"{d['job_json_p50_ms']} / {d['job_json_p99_ms']} ms, {d['job_json_calls']} calls, "
                f"{d['sse_documents']} SSE documents, {d['non_200']} non-200" if d else "-")
        lines.append(f"| {p['variant']} (run {p['repeat'] + 1}) | {p['rollouts_per_s']:.0f} | {p['ctl_cores']:.2f} "
                     f"| {p99['lease']:.0f} / {p99['heartbeat']:.0f} / {p99['results']:.0f} "
                     f"| {p['audit']['lost']}/{p['audit']['duplicated']} "
                     f"| {seen} "
                     f"| {p['load_avg'][0]}–{p['load_avg'][1]} |")
    for variant in dict.fromkeys(p["variant"] for p in points):
        mine = [p for p in points if p["variant"] == variant]
        beat = _median([p["p99_ms"]["heartbeat"] for p in mine])
        rate = _median([p["rollouts_per_s"] for p in mine])
        d = [p["dashboards"] for p in mine if p.get("dashboards")]
        json_ms = (f"{_median([x['job_json_p50_ms'] for x in d]):.1f} / {_median([x['job_json_p99_ms'] for x in d]):.1f}"
                   if d else "-")
        medians.append(f"| {variant} | {len(mine)} | {rate:.0f} | {_median([p['ctl_cores'] for p in mine]):.2f} "
                       f"| {beat:.0f} | {json_ms} |")
        rows.append({"benchmark": f"scale {nodes} nodes with {variant} (`ui_live`, median of {len(mine)})",
                     "ours": f"{rate:.0f} rollouts/s, beat p99 {beat:.0f} ms", "baseline": "-", "ratio": None,
                     "target": "p99 ≤ 50 ms with dashboards open" if d else "-",
                     "met": beat <= 50 if d else None})
    section = (f"{MARKER} ({nodes} simulated nodes × 64 slots, {window:.0f} s window)\n\n"
               f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. `{command}` (raw: `scale-results/ui-live*.json`). Each dashboard: a session from `POST /ui/login`, the job's SSE stream "
               "followed, the job page's JSON fetched every second. Runs interleaved; medians first.\n\n"
               "| run | runs | rollouts/s | ctl cores | p99 ms beat | job page JSON p50 / p99 ms |\n|---|---|---|---|---|---|\n"
               + "\n".join(medians) + "\n\nEach run:\n\n"
               "| run | rollouts/s | ctl cores | p99 ms lease / beat / results | lost/dup | job page JSON p50 / p99, calls, "
               "SSE | load |\n|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n")
    path = HERE / "results" / "RESULTS-ui.md"
    head = path.read_text().split(MARKER)[0] if path.exists() else "# UI\n"
    path.write_text(head.rstrip("\n") + "\n" + section)
    return rows


if __name__ == "__main__":  # python -m bench.bench_ui_live RAW.json...: the section again from saved runs together
    import sys

    raws, points = [json.loads(Path(f).read_text()) for f in sys.argv[1:]], []
    for r in raws:  # the runs of each file numbered after the previous file's
        first = 1 + max((p["repeat"] for p in points), default=-1)
        points += [{**p, "repeat": first + p.get("repeat", 0)} for p in r["points"]]
    write_results(points, " ; ".join(r.get("command", "?") for r in raws))
