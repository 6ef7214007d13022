"""`bench scale` with dashboards open: the UI costs the node hot path nothing (issue 27).

Runs one `bench_scale.point` per configuration on the same machine, one after the other: without dashboards, then
with each count of `$ROLLOUTD_UI_DASHBOARDS` (default "1,4") browsers' worth of clients on the job page for the
whole run, each logged in through `POST /ui/login` (a session cookie, as a browser) and doing what the page does
and more: following the job's server-sent events (`/ui/api/jobs/default/{job}/stream`) and fetching the job page's
JSON every second. Reported for each: p99 of the node calls (lease, beat, results), rollouts/s over the window,
the machine's load, and the controller's event loop (`controller/health/looplag.py`, read from /metrics every 2 s):
its lag's p99 and largest value over the window (the longest synchronous slice, near enough), the lags above
5 and 20 ms, and the garbage collector's pauses; for the dashboards: the job page JSON's p50/p99 and the SSE
documents received.

    ROLLOUTD_SCALE_NICE=-10 ROLLOUTD_UI_NODES=1000 ROLLOUTD_UI_WINDOW=60 python -m bench ui_live
(`$ROLLOUTD_UI_REPEATS` runs of each, interleaved, medians reported; `$ROLLOUTD_UI_BEFORE=REV` adds that revision's
controller with each count of dashboards, side by side; `$ROLLOUTD_UI_PROFILE=S` py-spies the controller for S seconds
after each window, the dashboards still open: top frames in the raw file, the stacks in $TMPDIR) appends a dated run to the section "With dashboards open" of
bench/results/RESULTS-ui.md (what is above and below stays as kept by hand; bench_ui.py keeps the part above) and
writes bench/results/scale-results/ui-live.json. Next step: a real chromium as one of the dashboards.
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
from prometheus_client.parser import text_string_to_metric_families

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


class LoopWatch:
    """The controller's event loop metrics (`controller/health/looplag.py`) read every `every` seconds: histogram
    snapshots for the window's deltas, and the largest lag gauge (it covers the last 5–10 s, so every stall is seen)."""

    LAG, MAX, GC = "rolloutd_event_loop_lag_seconds", "rolloutd_event_loop_lag_max_seconds", "rolloutd_gc_pause_seconds"
    STEP = "rolloutd_ui_step_cpu_seconds"  # each step of the UI's builds on the loop (this tree's, not an older one's)

    def __init__(self, url: str, token: str, every: float = 2.0) -> None:
        self.client = httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"})
        self.every, self.stop_ev = every, threading.Event()
        self.snapshots: list[tuple[float, dict]] = []  # (time, {(metric, le or generation): value})
        self.maxima: list[tuple[float, float]] = []  # (time, largest lag of the last 5–10 s)
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stop_ev.is_set():
            t = time.time()
            try:
                r = self.client.get("/metrics")
                text = r.text if r.status_code == 200 else ""
            except Exception:  # noqa: BLE001 - a missed reading: the next one covers it
                text = ""
            snap: dict = {}
            for fam in text_string_to_metric_families(text):
                for smp in fam.samples:
                    if smp.name == self.MAX:
                        self.maxima.append((t, smp.value))
                    elif smp.name.startswith((self.LAG + "_", self.GC + "_", self.STEP + "_")):  # GC generations summed
                        key = (smp.name, float(smp.labels["le"]) if "le" in smp.labels else None)
                        snap[key] = snap.get(key, 0.0) + smp.value
            if snap:
                self.snapshots.append((t, snap))
            self.stop_ev.wait(max(0.0, self.every - (time.time() - t)))

    def report(self, w0: float, w1: float) -> dict | None:
        """The window's lags (from the snapshots nearest its ends) and its largest lag, in ms; None when the controller
        has no such metrics (an older revision)."""
        inside = [s for t, s in self.snapshots if w0 - self.every <= t <= w1 + self.every]
        if len(inside) < 2:
            return None
        a, b = inside[0], inside[-1]
        d = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in b}
        n = d.get((self.LAG + "_count", None), 0.0)
        above = lambda name, le: d.get((name + "_count", None), 0) - d.get((name + "_bucket", le), 0)  # noqa: E731
        bounds = sorted(le for (name, le) in d if name == self.LAG + "_bucket")
        p99 = next(le for le in bounds if d[(self.LAG + "_bucket", le)] >= 0.99 * n)  # the bucket's upper bound
        steps = d.get((self.STEP + "_count", None))
        longest = next((le for le in sorted(le for (name, le) in d if name == self.STEP + "_bucket")
                        if d[(self.STEP + "_bucket", le)] >= steps), None) if steps else None
        return {"samples": int(n), "p99_le_ms": p99 * 1e3,
                "mean_ms": round(d.get((self.LAG + "_sum", None), 0.0) / max(n, 1) * 1e3, 2),
                "max_ms": round(max((v for t, v in self.maxima if w0 + 5 <= t <= w1 + 5), default=float("nan")) * 1e3, 1),
                "over_5ms": int(above(self.LAG, 0.005)), "over_20ms": int(above(self.LAG, 0.02)),
                "gc_pauses": int(d.get((self.GC + "_count", None), 0)),
                "gc_ms": round(d.get((self.GC + "_sum", None), 0.0) * 1e3, 1),
                "gc_over_20ms": int(above(self.GC, 0.02)),
                "ui_steps": None if steps is None else int(steps), "ui_step_max_le_ms": longest and longest * 1e3}

    def close(self) -> None:
        self.stop_ev.set()
        self.thread.join(5)
        self.client.close()


class Watch:
    """What `bench_scale.point` runs beside the nodes: the loop metrics always, the dashboards when `n` > 0."""

    def __init__(self, url: str, token: str, job: str, n: int) -> None:
        self.loop = LoopWatch(url, token)
        self.ui = Dashboards(url, token, job, n) if n else None

    def report(self, w0: float, w1: float) -> dict:
        return {"loop": self.loop.report(w0, w1), "ui": self.ui.report(w0, w1) if self.ui else None}

    def close(self) -> None:
        self.loop.close()
        if self.ui:
            self.ui.close()


def _median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2 if xs else float("nan")


def run(quick: bool = False) -> list[dict]:
    nodes = int(os.environ.get("ROLLOUTD_UI_NODES", "100" if quick else "1000"))
    window = float(os.environ.get("ROLLOUTD_UI_WINDOW", "15" if quick else "60"))
    counts = [int(x) for x in os.environ.get("ROLLOUTD_UI_DASHBOARDS", "1,4").split(",") if x.strip()]
    repeats = int(os.environ.get("ROLLOUTD_UI_REPEATS", "1"))
    before = os.environ.get("ROLLOUTD_UI_BEFORE")  # a git revision: its controller with each count of dashboards too
    label = os.environ.get("ROLLOUTD_UI_LABEL", "")  # the raw file: scale-results/ui-live-LABEL.json
    profile = float(os.environ.get("ROLLOUTD_UI_PROFILE", "0"))  # seconds of py-spy after each window
    points = []
    with contextlib.ExitStack() as stack:
        src = stack.enter_context(older_source(before)) if before else None
        configs = [("this tree", None, 0)]
        for n in dict.fromkeys(c for c in counts if c):
            configs += [("this tree", None, n)] + ([(before, src, n)] if before else [])
        for r in range(repeats):  # interleaved: a change of the machine's load falls on every configuration
            for code, src, dash in configs:
                watch = lambda url, token, job, dash=dash: Watch(url, token, job, dash)  # noqa: E731
                p = point(nodes, 1.0, window, profile, src=src, variant=f"{dash} dashboard{'s' * (dash != 1)}, {code}",
                          watch=watch)
                p.update(repeat=r)  # `point` keeps the watch's loop metrics and dashboards apart
                points.append(p)
                print(f"   N={nodes} {p['variant']} #{r}: {p['rollouts_per_s']}/s, p99 {p['p99_ms']}, "
                      f"loop {p['loop']}, dashboards {p['dashboards']}, load {p['load_avg']}", flush=True)
    command = (f"ROLLOUTD_SCALE_NICE=-10 ROLLOUTD_UI_NODES={nodes} ROLLOUTD_UI_WINDOW={window:.0f} "
               f"ROLLOUTD_UI_DASHBOARDS={','.join(map(str, counts))} ROLLOUTD_UI_REPEATS={repeats}"
               + (f" ROLLOUTD_UI_BEFORE={before}" if before else "") + (f" ROLLOUTD_UI_PROFILE={profile:g}" if profile else "")
               + " python -m bench ui_live")
    (HERE / "results" / "scale-results").mkdir(exist_ok=True)
    raw = HERE / "results" / "scale-results" / f"ui-live{'-' + label if label else ''}.json"
    raw.write_text(json.dumps({"command": command, "points": points}, indent=1))
    return write_results(points, command, raw.name)


def _loop_cells(lp: dict | None) -> str:
    if not lp:
        return "- | - | - | - | -"
    steps = (f"{lp['ui_steps']}, ≤ {lp['ui_step_max_le_ms']:g} ms" if lp.get("ui_step_max_le_ms")
             else "-" if lp.get("ui_steps") is None else str(lp["ui_steps"]))
    return (f"{lp['max_ms']:.0f} | ≤ {lp['p99_le_ms']:.0f} | {lp['over_5ms']} / {lp['over_20ms']} "
            f"| {lp['gc_pauses']}, {lp['gc_ms']:.0f} ms | {steps}")


def section(points: list[dict], command: str, raw: str) -> tuple[str, list[dict]]:
    """One dated run's text for RESULTS-ui.md (medians, then each run), and the bench's rows."""
    nodes, window = points[0]["nodes"], points[0]["window_s"]
    rows, lines, medians = [], [], []
    for p in points:
        p99, d = p["p99_ms"], p.get("dashboards")
        seen = (f"{d['job_json_p50_ms']} / {d['job_json_p99_ms']} ms, {d['job_json_calls']} calls, "
                f"{d['sse_documents']} SSE, {d['non_200']} non-200" if d else "-")
        lines.append(f"| {p['variant']} (run {p['repeat'] + 1}) | {p['rollouts_per_s']:.0f} | {p['ctl_cores']:.2f} "
                     f"| {p99['lease']:.0f} / {p99['heartbeat']:.0f} / {p99['results']:.0f} "
                     f"| {_loop_cells(p.get('loop'))} | {p['audit']['lost']}/{p['audit']['duplicated']} "
                     f"| {seen} | {p['load_avg'][0]}–{p['load_avg'][1]} |")
    base = None
    for variant in dict.fromkeys(p["variant"] for p in points):
        mine = [p for p in points if p["variant"] == variant]
        beat = _median([p["p99_ms"]["heartbeat"] for p in mine])
        stall = _median([(p.get("loop") or {}).get("max_ms", float("nan")) for p in mine])
        over5 = _median([(p.get("loop") or {}).get("over_5ms", float("nan")) for p in mine])
        base = beat if base is None else base  # the first variant: no dashboards
        rate = _median([p["rollouts_per_s"] for p in mine])
        d = [p["dashboards"] for p in mine if p.get("dashboards")]
        json_ms = (f"{_median([x['job_json_p50_ms'] for x in d]):.1f} / {_median([x['job_json_p99_ms'] for x in d]):.1f}"
                   if d else "-")
        medians.append(f"| {variant} | {len(mine)} | {rate:.0f} | {_median([p['ctl_cores'] for p in mine]):.2f} "
                       f"| {beat:.0f} | {beat / base:.2f}× | {stall:.0f} | {over5:.0f} | {json_ms} |")
        rows.append({"benchmark": f"scale {nodes} nodes with {variant} (`ui_live`, median of {len(mine)})",
                     "ours": f"{rate:.0f} rollouts/s, beat p99 {beat:.0f} ms, longest loop stall {stall:.0f} ms",
                     "baseline": f"no dashboard: beat p99 {base:.0f} ms" if d else "-",
                     "ratio": beat / base if d else None,
                     "target": "beat p99 within the no-dashboard run's" if d else "-", "met": None})
    text = (f"\n### {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: {nodes} simulated nodes × 64 slots, {window:.0f} s window\n\n"
            f"`{command}` (raw: `scale-results/{raw}`). Each dashboard: a session from `POST /ui/login`, the job's "
            "SSE stream followed, the job page's JSON fetched every second. Runs interleaved; medians first. "
            "Loop: the controller's event loop lag (`rolloutd_event_loop_lag_seconds`, sampled every 10 ms): the "
            "largest in the window (±5 s), its p99 (a bucket's bound), the samples above 5 / 20 ms; GC: collections "
            "and their time in the window; UI steps: the steps of the UI's builds on the loop (`rolloutd_ui_step_cpu_seconds`, CPU: "
            "not stretched by the machine's load) and the bucket bound of the longest (none for an older revision).\n\n"
            "| run | runs | rollouts/s | ctl cores | p99 ms beat | beat p99 ÷ none | longest loop stall ms "
            "| loop lags > 5 ms | job page JSON p50 / p99 ms |\n|---|---|---|---|---|---|---|---|---|\n"
            + "\n".join(medians) + "\n\nEach run:\n\n"
            "| run | rollouts/s | ctl cores | p99 ms lease / beat / results | longest loop stall ms | loop lag p99 ms "
            "| lags > 5 / > 20 ms | GC | UI steps, longest | lost/dup | job page JSON p50 / p99, calls, SSE | load |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n")
    return text, rows


def write_results(points: list[dict], command: str, raw: str = "ui-live.json") -> list[dict]:
    """Appends this run (one or more runs' raw points together) to RESULTS-ui.md's section "With dashboards open":
    every earlier run and note stays as it was (they are kept by hand). Returns the bench's rows."""
    text, rows = section(points, command, raw)
    path = HERE / "results" / "RESULTS-ui.md"
    old = path.read_text() if path.exists() else "# UI\n"
    if MARKER not in old:
        old = old.rstrip("\n") + "\n" + MARKER + "\n\nRuns of `python -m bench ui_live`, oldest first.\n"
    path.write_text(old.rstrip("\n") + "\n" + text)
    return rows


if __name__ == "__main__":  # python -m bench.bench_ui_live RAW.json...: the section again from saved runs together
    import sys

    raws, points = [json.loads(Path(f).read_text()) for f in sys.argv[1:]], []
    for r in raws:  # the runs of each file numbered after the previous file's
        first = 1 + max((p["repeat"] for p in points), default=-1)
        points += [{**p, "repeat": first + p.get("repeat", 0)} for p in r["points"]]
    write_results(points, " ; ".join(r.get("command", "?") for r in raws), ", ".join(Path(f).name for f in sys.argv[1:]))
