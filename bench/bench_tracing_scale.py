"""What tracing costs the controller at scale and the node daemons per rollout: whole runs with ROLLOUTD_TRACING off and
on, interleaved (a pair of runs per repeat, its order drawn at random), CPU seconds per rollout from /proc.

Where it sits: `python -m bench tracing_scale` (or alone: ``python -m bench.bench_tracing_scale``). `bench tracing` times
the span hooks in one process; here the product runs: (1) the controller, a `bench_scale.point` at
`$ROLLOUTD_TS_NODES` (1000) simulated nodes × 64 slots, its CPU (/proc/PID/stat, every thread: the batch exporter's
included) over a `$ROLLOUTD_TS_WINDOW` (20) s window per rollout accepted in it; (2) the node daemons, a
`bench_pipeline`-style job (2 local daemons, one-turn math rollouts against the instant stub LLM), the daemons' and the
controller's CPU between the 10th and 90th percentile of the rollouts' ends (start-up left out). `$ROLLOUTD_TS_REPEATS`
(3) pairs each. With tracing on, every process exports over OTLP/HTTP (the SDK's exporter, standard OTEL_* variables)
to a receiver in this process that decodes each request and counts the spans, so sending is real and checked.
Reported: median CPU per rollout off and on, the median of the pairs' on/off ratios and their spread, spans received
per rollout. `$ROLLOUTD_TS_REVS=rev1,rev2`: those revisions' controllers and daemons (git archive) instead of this tree's,
side by side in every round. Raw runs: bench/results/scale-results/tracing-scale-DATE.json; results:
bench/results/RESULTS-tracing.md. A cost, not a throughput: with `ROLLOUTD_NODE_CALLS_PER_SECOND` below what the
controller serves (100 at 300 nodes) the daemons beat at a fixed interval and the controller is not saturated (a
saturated one takes what CPU the box gives it: such rounds are flagged and left out); at 1000 nodes also
`$ROLLOUTD_TS_TIME_FACTOR` (0.5: rollouts twice as long, half the rate offered; the daemons' beats keep their real
pace), so that the results alone do not saturate it.
"""
from __future__ import annotations

import contextlib
import gzip
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent


class Receiver:
    """An OTLP/HTTP trace receiver: decodes every `ExportTraceServiceRequest` and counts the spans by name, and the
    roots (`rollout`) by their `rolloutd.outcome`."""

    def __init__(self) -> None:
        self.names: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.requests = 0
        self._lock = threading.Lock()
        me = self

        class Handler(BaseHTTPRequestHandler):
            # connections kept alive, as an OpenTelemetry collector's: one closed after every request cost the
            # exporter ~0.3 ms more CPU per request (~1 µs per rollout; bench/results/RESULTS-tracing.md)
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest.FromString(body)
                spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
                got = Counter(s.name for s in spans)
                ends = Counter(a.value.string_value for s in spans if s.name == "rollout" for a in s.attributes
                               if a.key == "rolloutd.outcome")
                with me._lock:
                    me.names.update(got)
                    me.outcomes.update(ends)
                    me.requests += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self) -> dict:
        """The spans received since the last take, by name, and the requests that carried them."""
        with self._lock:
            out = {"spans": dict(self.names), "roots": dict(self.outcomes), "requests": self.requests}
            self.names, self.outcomes, self.requests = Counter(), Counter(), 0
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def traced(on: bool, receiver: Receiver):
    """The environment every process started inside inherits: tracing on (to `receiver`) or off."""
    with mock.patch.dict(os.environ):  # the whole environment as it was, restored at the end
        for k in ("ROLLOUTD_TRACING", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            os.environ.pop(k, None)
        if on:
            os.environ.update({"ROLLOUTD_TRACING": "1", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.url})
        yield


def controller_run(on: bool, receiver: Receiver, nodes: int, window: float, rev: str = "", src: Path | None = None) -> dict:
    """One `bench scale` point with tracing `on` or off: the controller's CPU per rollout over the window (the
    controller of revision `rev`, from `src`, when given: `bench_scale.older_source`)."""
    from bench.bench_scale import point

    receiver.take()
    with traced(on, receiver):
        # $ROLLOUTD_TS_TIME_FACTOR: rollouts that many times shorter (0.5: half the offered rate of 1.0); the
        # daemons' beats keep their real pace (the controller's beat gap against its leases' seconds)
        os.environ["ROLLOUTD_SCALE_DURATIONS_ONLY"] = "1"
        p = point(nodes, float(os.environ.get("ROLLOUTD_TS_TIME_FACTOR", "1")), window, src=src,
                  variant="on" if on else "off")
    time.sleep(1.0)   # the controller flushed its batch at exit: let the last request land
    got = receiver.take()
    return {"on": on, "rev": rev, "nodes": nodes, "ms_per_rollout": p["ctl_ms_per_rollout"], "cores": p["ctl_cores"],
            # a controller that cannot keep up takes what CPU the box gives it: per rollout that measures the box
            "saturated": p["rollouts_per_s"] < 0.9 * p["offered_per_s"], "offered_per_s": p["offered_per_s"],
            "rollouts_per_s": p["rollouts_per_s"], "rollouts": p["rollouts"], "accepted": p["audit"]["accepted"],
            "lost": p["audit"]["lost"], "p99_ms": p["p99_ms"], "load": p["load_avg"], **got}


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _samples(ctl: int, out: list, stop: threading.Event) -> None:
    """Every 50 ms: (wall time, the controller's CPU seconds, its children's (the daemons') CPU seconds so far)."""
    from bench.bench_pipeline import _cpu_seconds
    seen: dict[int, float] = {}
    while not stop.is_set():
        for pid in _children(ctl):
            with contextlib.suppress(OSError):
                seen[pid] = _cpu_seconds(pid)
        with contextlib.suppress(OSError):
            out.append((time.time(), _cpu_seconds(ctl), sum(seen.values())))
        stop.wait(0.05)


def _at(samples: list, t: float) -> tuple[float, float]:
    """(controller, daemons) CPU seconds at wall time `t`, interpolated between the samples around it."""
    for (t0, c0, d0), (t1, c1, d1) in zip(samples, samples[1:]):
        if t0 <= t <= t1:
            f = (t - t0) / max(t1 - t0, 1e-9)
            return c0 + f * (c1 - c0), d0 + f * (d1 - d0)
    raise ValueError(f"{t} outside the samples")


def daemon_run(on: bool, receiver: Receiver, backend: str, tokenizer: str, source: Path, prompts: int,
               samples: int, rev: str = "", src: Path | None = None) -> dict:
    """One controller with 2 local daemons running a math job against the stub: the daemons' and the controller's
    CPU per rollout between the 10th and 90th percentile of the rollouts' ends (revision `rev`'s controller and
    daemons, from `src` first on their PYTHONPATH, when given: `bench_scale.older_source`)."""
    from bench.bench_pipeline import P, PLUGINS, _job, _port, _wait_phase, start_controller
    from bench.bench_scale import _prioritize

    receiver.take()
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-tracing-"))
    with traced(on, receiver):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src or ""), str(PLUGINS),
                                                                          os.environ.get("PYTHONPATH")]))}
        ctl, api = start_controller(tmp / "data", _port(), env)
    _prioritize(ctl.pid)   # $ROLLOUTD_SCALE_NICE: its session (the daemons are in it) as `bench scale` does
    try:
        trace: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=_samples, args=(ctl.pid, trace, stop), daemon=True)
        sampler.start()
        n = prompts * samples
        api.put(f"{P}/rolloutjobs/bench", json=_job("bench", source, tokenizer, backend, prompts, samples)).raise_for_status()
        _wait_phase(api, "bench", "Succeeded")
        lines = api.get(f"{P}/rolloutjobs/bench/trajectories", params={"limit": 100000}).text.splitlines()
        trajectories = [json.loads(line) for line in lines]
        assert len(trajectories) == n and all(t["failure"]["kind"] == "none" for t in trajectories)
        deadline = time.monotonic() + 15   # tracing on: the roots (ended as results are taken) reach the receiver
        while on and receiver.names["rollout"] < n and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.3)
        stop.set()
        sampler.join()
        ends = sorted(t["timings"]["stamps"]["end"] for t in trajectories)
        lo, hi = ends[n // 10], ends[n * 9 // 10]
        (c0, d0), (c1, d1) = _at(trace, lo), _at(trace, hi)
        counted = n * 9 // 10 - n // 10
        api.close()
    finally:
        os.killpg(ctl.pid, signal.SIGTERM)
        ctl.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)   # its data dir and the daemons' logs (~10 MB a run)
    time.sleep(1.0)
    got = receiver.take()
    return {"on": on, "rev": rev, "rollouts": n, "daemons_ms_per_rollout": (d1 - d0) / counted * 1e3,
            "ctl_ms_per_rollout": (c1 - c0) / counted * 1e3, "window_s": hi - lo, "load": os.getloadavg()[0], **got}


def _pairs(runs: list[dict], key: str, rev: str = "") -> dict:
    """Per side the median of `key`; the median and the list of the pairs' on/off ratios (a pair: a repeat's runs),
    pairs with a saturated run left out (counted)."""
    offs = [r for r in runs if not r["on"] and r.get("rev", "") == rev]
    ons = [r for r in runs if r["on"] and r.get("rev", "") == rev]
    pairs = [(a, b) for a, b in zip(offs, ons) if not a.get("saturated") and not b.get("saturated") and a[key]]
    nan = float("nan")
    return {"off": statistics.median([a[key] for a, _ in pairs]) if pairs else nan,
            "on": statistics.median([b[key] for _, b in pairs]) if pairs else nan,
            "ratio": statistics.median([b[key] / a[key] for a, b in pairs]) if pairs else nan,
            "ratios": [round(b[key] / a[key], 3) for a, b in pairs], "left_out": len(offs) - len(pairs)}


def _interleaved(repeats: int, one, revs: tuple[str, ...] = ("",)) -> list[dict]:
    """`repeats` rounds of runs, off and on for each of `revs`, each round's order drawn at random."""
    rng = random.Random(int(os.environ.get("ROLLOUTD_TS_SEED", "1")))
    runs: list[dict] = []
    for i in range(repeats):
        order = [(on, rev) for rev in revs for on in (False, True)]
        rng.shuffle(order)
        got = {}
        for on, rev in order:
            t0 = time.monotonic()
            r = got[on, rev] = one(on, rev) if rev else one(on)
            print(f"   round {i + 1}, tracing {'on' if on else 'off'} {rev}: {json.dumps(r)} "
                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
        runs += [got[on, rev] for rev in revs for on in (False, True)]
    return runs


def run(quick: bool = False) -> list[dict]:
    from bench.bench_pipeline import REPO, _dataset, _port, _wait_http
    from bench.bench_scale import older_source
    from rolloutd.agents.engine.model_dirs import prepare_model

    nodes = 100 if quick else int(os.environ.get("ROLLOUTD_TS_NODES", "1000"))
    repeats = 1 if quick else int(os.environ.get("ROLLOUTD_TS_REPEATS", "3"))
    window = 10.0 if quick else float(os.environ.get("ROLLOUTD_TS_WINDOW", "20"))
    prompts, samples = (32, 8) if quick else (250, 8)
    parts = os.environ.get("ROLLOUTD_TS_PARTS", "controller,daemons").split(",")
    from bench.bench_scale import _prioritize

    _prioritize(os.getpid())   # the receiver here as the controller: one starved would back up its exporter's queue
    receiver = Receiver()
    out: dict = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nodes": nodes, "window_s": window,
                 "code": os.environ.get("ROLLOUTD_TS_LABEL", "this tree"), "load": os.getloadavg()[0],
                 "time_factor": float(os.environ.get("ROLLOUTD_TS_TIME_FACTOR", "1")),
                 "node_calls_per_second": os.environ.get("ROLLOUTD_NODE_CALLS_PER_SECOND")}
    try:
        # $ROLLOUTD_TS_REVS=main,HEAD: those revisions' processes side by side (each off and on), else this tree's
        revs = tuple(filter(None, os.environ.get("ROLLOUTD_TS_REVS", "").split(",")))
        out["revs"] = list(revs)
        with contextlib.ExitStack() as stack:
            srcs = {rev: stack.enter_context(older_source(rev)) for rev in revs}
            if "controller" in parts:
                out["controller"] = _interleaved(repeats, lambda on, rev="": controller_run(
                    on, receiver, nodes, window, rev, srcs.get(rev)), revs or ("",))
            if "daemons" in parts:
                tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-tracing-"))
                tokenizer, source, port = str(prepare_model("tiny")), _dataset(tmp, prompts), _port()
                stub = subprocess.Popen([sys.executable, "-m", "bench.stub_backend", "--port", str(port),
                                         "--tokenizer", tokenizer], cwd=REPO, start_new_session=True)
                try:
                    _wait_http(f"http://127.0.0.1:{port}/health")
                    out["daemons"] = _interleaved(repeats, lambda on, rev="": daemon_run(
                        on, receiver, f"http://127.0.0.1:{port}", tokenizer, source, prompts, samples, rev,
                        srcs.get(rev)), revs or ("",))
                finally:
                    os.killpg(stub.pid, signal.SIGTERM)
                    stub.wait(20)
                    shutil.rmtree(tmp, ignore_errors=True)
    finally:
        receiver.close()
    res = HERE / "results" / "scale-results"
    res.mkdir(exist_ok=True)
    (res / f"tracing-scale-{time.strftime('%Y%m%d-%H%M', time.gmtime())}-{'-'.join(parts)}.json").write_text(json.dumps(out, indent=1))
    return rows(out)


def rows(out: dict) -> list[dict]:
    result = []
    for rev in (out.get("revs") or [""]) if out.get("controller") else []:
        runs = [r for r in out["controller"] if r.get("rev", "") == rev]
        c = _pairs(runs, "ms_per_rollout", rev)
        on = [r for r in runs if r["on"]]
        # the roots (and queue spans) of the attempts in flight at the stop, ended then, are not the accepted ones'
        stopped = [r.get("roots", {}).get("controller stopped", 0) for r in on]
        spans = statistics.median((sum(r["spans"].values()) - 2 * n) / max(r["accepted"], 1) for r, n in zip(on, stopped))
        roots = "" if not all("roots" in r for r in on) else (
            f"; roots received {min(r['roots'].get('done', 0) / max(r['accepted'], 1) for r in on):.2%} of the accepted "
            f"at worst, {statistics.median(stopped):.0f} ended at the stop")
        result.append({
            "benchmark": f"controller{' at ' + rev if rev else ''} CPU per rollout, tracing off vs on, {out['nodes']} "
                         f"simulated nodes × 64 ({len(runs) // 2} interleaved pairs, `tracing_scale`)",
            "ours": f"on {c['on']:.3f} ms ({spans:.2f} spans received per accepted rollout{roots})",
            "baseline": f"off {c['off']:.3f} ms", "ratio": c["ratio"],
            "target": "≤ 1.05× (pairs: " + ", ".join(f"{x:.2f}×" for x in c["ratios"])
                      + (f"; {c['left_out']} saturated left out" if c["left_out"] else "") + ")",
            "met": c["ratio"] <= 1.05})
    for rev in (out.get("revs") or [""]) if out.get("daemons") else []:
        runs = [r for r in out["daemons"] if r.get("rev", "") == rev]
        d, c = _pairs(runs, "daemons_ms_per_rollout", rev), _pairs(runs, "ctl_ms_per_rollout", rev)
        spans = statistics.median(sum(r["spans"].values()) / r["rollouts"] for r in runs if r["on"])
        result.append({
            "benchmark": f"node daemons' CPU per rollout ({rev or out.get('code', 'this tree')}), tracing off vs on, "
                         f"one-turn math rollouts vs the stub LLM "
                         f"({len(runs) // 2} interleaved pairs, `tracing_scale`)",
            "ours": f"on {d['on']:.3f} ms ({spans:.1f} spans received per rollout); controller here "
                    f"{c['off']:.3f} → {c['on']:.3f} ms ({c['ratio']:.2f}×)",
            "baseline": f"off {d['off']:.3f} ms", "ratio": d["ratio"],
            "target": "reported (pairs: " + ", ".join(f"{x:.2f}×" for x in d["ratios"]) + ")", "met": None})
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rows"]:   # python -m bench.bench_tracing_scale --rows scale-results/tracing-scale-….json
        from bench.__main__ import render
        print(render(rows(json.loads(Path(sys.argv[2]).read_text()))))
        sys.exit(0)
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv)))
