"""What a dashboard costs the nodes, measured inside one run: the same controller and nodes, the dashboard opened
and closed every few seconds, the node calls of its "on" phases against those of its "off" phases (issue 27).

Where it sits: `python -m bench ui_toggle` (or alone: ``python -m bench.bench_ui_toggle``). `bench_ui_live.py`
compares whole runs, one without and one with dashboards; on this 2-core machine one run's beat p99 moves by 2-3×
from the next as the load moves, more than a dashboard costs. Here every phase shares its neighbours' load: a
`bench_scale.point` at `$ROLLOUTD_UI_NODES` (1000) simulated nodes, during which `$ROLLOUTD_UI_DASHBOARDS` (1)
dashboards (`bench_ui_live.Dashboards`: a login, the job's SSE stream, its JSON every second) are open for
`$ROLLOUTD_UI_PHASE` (10) seconds, closed for as long, and so on over `$ROLLOUTD_UI_WINDOW` (120) seconds, each pair
of phases in a random order (strict alternation put a periodic stall on one side: 0 dashboards "open" gave 3.6×).
`$ROLLOUTD_UI_DASHBOARDS=0` is the null run: what a ratio looks like when nothing differs. A call counts in
the phase it started in, the phase's first `$ROLLOUTD_UI_SETTLE` (1) seconds left out (the switch). Per side:
beat p99 and p50, calls, the controller's CPU (/proc) and the loop's lags above 5 ms (`bench_ui_live.LoopWatch`,
per phase).
Appends a dated section to bench/results/RESULTS-ui.md, the raw run (every beat) to
scale-results/ui-toggle-DATE-TIME.json.gz. One run's ratio moves 0.7-1.7× with nothing changed: `python -m
bench.bench_ui_toggle interval` pools the raw runs, with a 90 % interval from resampling pairs of phases.
Next step: a real chromium as the dashboard.
"""
from __future__ import annotations

import gzip
import json
import os
import random
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.bench_scale import _cpu_seconds, _pct, point
from bench.bench_ui_live import Dashboards, LoopWatch

HERE = Path(__file__).resolve().parent
# s: the start of each phase left out: the dashboard logging in or going away, and its first build catching up on
# the rows of the closed phase before (~13 000 at 1000 nodes: a steady dashboard catches up 1-5 s of them)
SETTLE = float(os.environ.get("ROLLOUTD_UI_SETTLE", "1"))


class Toggled:
    """A `bench_scale.point` watch: the loop's metrics throughout, `n` dashboards open every other phase."""

    def __init__(self, url: str, token: str, job: str, n: int, phase: float) -> None:
        self.url, self.token, self.job, self.n, self.phase = url, token, job, n, phase
        self.loop = LoopWatch(url, token, every=2.0)
        self.pid: int | None = None  # the controller's, set by `point` (its CPU per phase)
        self.phases: list[dict] = []  # {"on", "start", "end", "cpu0", "cpu1"}
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _cpu(self) -> float:
        return _cpu_seconds(self.pid) if self.pid else float("nan")

    def _run(self) -> None:
        order = random.Random()  # each pair of phases in a random order: a periodic stall (every 20 s, say) of
        on, pair = False, []       # the controller or the nodes must not fall on one side only
        while not self.stop_ev.is_set():
            if not pair:
                pair = order.sample([True, False], 2)
            on = pair.pop()
            dash = Dashboards(self.url, self.token, self.job, self.n) if on else None
            start, cpu0 = time.time(), self._cpu()
            self.stop_ev.wait(self.phase)
            if dash is not None:
                dash.close()
            self.phases.append({"on": on, "start": start, "end": time.time(), "cpu0": cpu0, "cpu1": self._cpu()})

    def report(self, w0: float, w1: float) -> dict:
        return {"loop": self.loop.report(w0, w1), "ui": None}

    def split(self, latency: dict[str, list[tuple[float, float]]], w0: float, w1: float) -> dict:
        """The window's calls (kind → (start, ms)) and the loop's lags by side: "on" and "off"; under "each", every
        phase of the window in order with its pair (the two phases drawn in a random order together) and its beats
        (ms, sorted: what `interval` pools across runs)."""
        out: dict = {"each": []}
        for i, p in enumerate(self.phases):
            if p["start"] >= w0 and p["end"] <= w1:
                a, b = p["start"] + SETTLE, p["end"]
                out["each"].append({"pair": i // 2, "on": p["on"], "start": round(p["start"], 3),
                                    "cpu": round(p["cpu1"] - p["cpu0"], 3), "seconds": round(b - a, 2),
                                    "beats": sorted(round(ms, 2) for t, ms in latency.get("heartbeat", []) if a <= t < b)})
        for side in (True, False):
            spans = [(p["start"] + SETTLE, p["end"]) for p in self.phases
                     if p["on"] is side and p["start"] >= w0 and p["end"] <= w1]
            inside = lambda t: any(a <= t < b for a, b in spans)  # noqa: E731
            beats = [ms for t, ms in latency.get("heartbeat", []) if inside(t)]
            each = sorted(_pct([ms for t, ms in latency.get("heartbeat", []) if a <= t < b], 0.99) for a, b in spans)
            seconds = sum(b - a for a, b in spans)
            cpu = sum(p["cpu1"] - p["cpu0"] for p in self.phases
                      if p["on"] is side and p["start"] >= w0 and p["end"] <= w1)
            lags = [self.loop.report(a, b) for a, b in spans]
            out["on" if side else "off"] = {
                "phases": len(spans), "seconds": round(seconds, 1), "beats": len(beats),
                "beat_p50_ms": round(_pct(beats, 0.5), 2), "beat_p99_ms": round(_pct(beats, 0.99), 2),
                "phase_p99_ms": [round(x, 1) for x in each], "phase_p99_median_ms": round(_pct(each, 0.5), 1),
                "ctl_cores": round(cpu / max(sum(p["end"] - p["start"] for p in self.phases
                                                 if p["on"] is side and p["start"] >= w0 and p["end"] <= w1), 1e-9), 3),
                "lags_over_5ms_per_min": round(sum(x["over_5ms"] for x in lags if x) / max(seconds, 1e-9) * 60, 1)}
        return out

    def close(self) -> None:
        self.stop_ev.set()
        self.thread.join(30)
        self.loop.close()


def run(quick: bool = False) -> list[dict]:
    nodes = int(os.environ.get("ROLLOUTD_UI_NODES", "100" if quick else "1000"))
    window = float(os.environ.get("ROLLOUTD_UI_WINDOW", "40" if quick else "120"))
    phase = float(os.environ.get("ROLLOUTD_UI_PHASE", "10"))
    n = int(os.environ.get("ROLLOUTD_UI_DASHBOARDS", "1"))
    p = point(nodes, 1.0, window, variant=f"{n} dashboard(s) every other {phase:g} s",
              watch=lambda url, token, job: Toggled(url, token, job, n, phase))
    sides = p["phases"]
    on, off = sides["on"], sides["off"]
    command = (f"ROLLOUTD_SCALE_NICE=-10 ROLLOUTD_UI_NODES={nodes} ROLLOUTD_UI_WINDOW={window:g} "
               f"ROLLOUTD_UI_PHASE={phase:g} ROLLOUTD_UI_SETTLE={SETTLE:g} ROLLOUTD_UI_DASHBOARDS={n} python -m bench ui_toggle")
    raw = f"ui-toggle-{datetime.now(timezone.utc):%Y%m%d-%H%M}.json.gz"  # with every beat: ~200 kB of JSON
    (HERE / "results" / "scale-results").mkdir(exist_ok=True)
    (HERE / "results" / "scale-results" / raw).write_bytes(gzip.compress(json.dumps({"command": command, "point": p}).encode()))
    ratio = on["beat_p99_ms"] / off["beat_p99_ms"] if off["beat_p99_ms"] else None
    row = lambda name, s: (f"| {name} | {s['phases']} × {phase:g} s | {s['beats']} | {s['beat_p50_ms']} "  # noqa: E731
                           f"| {s['beat_p99_ms']} | {s['phase_p99_median_ms']} ({', '.join(map(str, s['phase_p99_ms']))}) "
                           f"| {s['ctl_cores']} | {s['lags_over_5ms_per_min']} |")
    text = (f"\n### {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: one run, the dashboard toggled ({nodes} simulated "
            f"nodes × 64 slots)\n\n`{command}` (raw: `scale-results/{raw}`). {p['rollouts_per_s']:.0f} "
            f"rollouts/s, lost/duplicated {p['audit']['lost']}/{p['audit']['duplicated']}, load "
            f"{p['load_avg'][0]}–{p['load_avg'][1]}. A phase's first {SETTLE:g} s left out.\n\n"
            "| dashboard | phases | beats | beat p50 ms | beat p99 ms | each phase's beat p99 ms: median (all, sorted) "
            "| controller cores | loop lags > 5 ms per minute |\n|---|---|---|---|---|---|---|---|\n" + row("open", on) + "\n" + row("closed", off) + "\n"
            + (f"\nBeat p99 open ÷ closed: **{ratio:.2f}×**.\n" if ratio else ""))
    path = HERE / "results" / "RESULTS-ui.md"
    path.write_text(path.read_text().rstrip("\n") + "\n" + text)
    print(text, flush=True)
    return [{"benchmark": f"scale {nodes} nodes, {n} dashboard(s) open every other {phase:g} s (`ui_toggle`)",
             "ours": f"beat p99 {on['beat_p99_ms']} ms open", "baseline": f"{off['beat_p99_ms']} ms closed",
             "ratio": ratio, "target": "≤ 1.1× (within the noise of one run)",
             "met": None if ratio is None else ratio <= 1.1}]


def _pooled_p99(pairs: list[dict], side: bool) -> float:
    return _pct([ms for pair in pairs for ms in pair[side]], 0.99)


def interval(paths: list[Path], resamples: int = 1000, seed: int = 27) -> str:
    """The runs in `paths` (raw files of `run`) pooled by their number of dashboards: the beats' p99 of every open
    phase against that of every closed one, and a 90 % interval for the ratio from resampling whole pairs of phases
    (a pair shares its load; a stall stays with its phase). The null runs (0 dashboards) show the interval when
    nothing differs. Returns the markdown table (also appended to RESULTS-ui.md by `main`)."""
    groups: dict[tuple[int, int], list[dict]] = {}  # (nodes, dashboards) → pairs
    runs: dict[tuple[int, int], list[str]] = {}
    for path in paths:
        raw = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
        each = (raw["point"].get("phases") or {}).get("each")
        if not each:
            continue  # a run from before the phases were kept one by one
        n = (int(raw["command"].split("ROLLOUTD_UI_NODES=")[1].split()[0]),
             int(raw["command"].split("ROLLOUTD_UI_DASHBOARDS=")[1].split()[0]))
        length = float(raw["command"].split("ROLLOUTD_UI_PHASE=")[1].split()[0])
        by_pair: dict[int, dict] = {}
        for ph in each:
            by_pair.setdefault(ph["pair"], {})[ph["on"]] = ph["beats"]
            by_pair[ph["pair"]]["cpu", ph["on"]] = ph["cpu"] / length  # the controller's cores over the phase
        groups.setdefault(n, []).extend(p for p in by_pair.values() if True in p and False in p)
        runs.setdefault(n, []).append(path.name)
    rng = random.Random(seed)
    lines = ["| nodes | dashboards | runs | pairs of phases | beats open / closed | beat p99 open / closed (ms) | ratio "
             "| 90 % interval (pairs resampled) | median of the pairs' ratios | controller cores, open − closed (90 %) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for n, pairs in sorted(groups.items()):
        on, off = _pooled_p99(pairs, True), _pooled_p99(pairs, False)
        ratios = sorted(_pooled_p99(d, True) / _pooled_p99(d, False)
                        for d in ([rng.choice(pairs) for _ in pairs] for _ in range(resamples)))
        each = sorted(_pct(p[True], 0.99) / _pct(p[False], 0.99) for p in pairs)
        cpu = [p["cpu", True] - p["cpu", False] for p in pairs]
        cpus = sorted(sum(d) / len(d) for d in ([rng.choice(cpu) for _ in cpu] for _ in range(resamples)))
        lines.append(f"| {n[0]} | {n[1]} | {len(runs[n])} | {len(pairs)} | {sum(len(p[True]) for p in pairs)} / "
                     f"{sum(len(p[False]) for p in pairs)} | {on:.1f} / {off:.1f} | **{on / off:.2f}×** | "
                     f"{_pct(ratios, 0.05):.2f}–{_pct(ratios, 0.95):.2f}× | {_pct(each, 0.5):.2f}× | "
                     f"{sum(cpu) / len(cpu):+.3f} ({_pct(cpus, 0.05):+.3f} to {_pct(cpus, 0.95):+.3f}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    """`interval [RAW ...] [--since YYYYMMDD-HHMM] [--until YYYYMMDD-HHMM]` (default: every kept raw run, or those
    of that span) prints and records the pooled intervals, by nodes and dashboards; without `interval`, one run."""
    if argv[:1] != ["interval"]:
        run()
        return
    args = argv[1:]
    since = args.pop(args.index("--since") + 1) if "--since" in args else ""  # YYYYMMDD-HHMM: runs from then on
    until = args.pop(args.index("--until") + 1) if "--until" in args else "9"
    args = [a for a in args if a not in ("--since", "--until")]
    paths = [Path(a) for a in args] or [p for p in sorted((HERE / "results" / "scale-results").glob("ui-toggle-*.json*"))
                                        if since <= p.name[len("ui-toggle-"):][:13] <= until]
    table = interval(paths)
    text = (f"\n### {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC: the toggled runs pooled "
            f"(`python -m bench.bench_ui_toggle interval {' '.join(a for a in argv[1:])}`)\n\n{table}")
    path = HERE / "results" / "RESULTS-ui.md"
    path.write_text(path.read_text().rstrip("\n") + "\n" + text)
    print(text, flush=True)


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
