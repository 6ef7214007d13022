"""The controller's tracing cost per rollout attempt, a revision's code path and this tree's side by side in one run.

Where it sits: `python -m bench tracing_hooks` (alone: ``python -m bench.bench_tracing_hooks``). `bench tracing` times
the hooks in a tight loop; here they run as in a busy controller: `$ROLLOUTD_TH_INFLIGHT` (20 000) attempts open,
each grant and end between a result's worth of other work (a trajectory parsed and dumped), so caches are as cold
as the process makes them. Modes alternate block by block: tracing off; on with `$ROLLOUTD_TH_BEFORE`'s (default
63aeba6) controller/work/tracing.py; on with this tree's (both on this tree's crds/kit/tracing.py and otlp.py). Spans
go over OTLP/HTTP (the SDK's client) to a sink in a process of its own; each block's batches are flushed in it.
Reported per attempt (medians of `$ROLLOUTD_TH_ROUNDS` blocks): the calling thread's CPU in the hooks
(`time.thread_time` around each, the timer's own cost taken off), the export thread's CPU
(/proc/self/task/TID/schedstat), and the whole process's CPU less tracing off's (the hooks' timers included). Next
step: the 1000-node `bench tracing_scale` on a quiet box.
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import multiprocessing
import os
import statistics
import subprocess
import time
import types
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from bench.bench_tracing import _Sink

REPO = Path(__file__).resolve().parent.parent
BEFORE = "63aeba6"   # main before trace7


def _module(rev: str) -> types.ModuleType:
    """`rev`'s controller/work/tracing.py as a module of its own (on this tree's crds/kit/tracing.py and otlp.py)."""
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:controller/work/tracing.py"], check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType(f"attempt_traces_{rev}")
    mod.__package__ = "rolloutd.controller.work"
    exec(compile(src, f"{rev}:controller/work/tracing.py", "exec"), mod.__dict__)  # noqa: S102 - our own source
    return mod


def _thread_cpu(tid: int) -> float:
    """CPU seconds of one thread of this process (ns resolution)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


class World:
    """What the hooks run among: the leases of every attempt, a result's worth of other work."""

    def __init__(self, inflight: int, steps: int) -> None:
        from rolloutd.crds.node import Lease
        from rolloutd.crds.trajectory import Trajectory

        self.Lease, self.inflight = Lease, inflight
        self.result = Trajectory(job="default/bench", prompt=3, sample=1, reward=1.0, finish_reason="stop",
                                 timings={"queue": 0.1, "init": 2.0, "run": 30.0, "eval": 8.0}).model_dump_json()
        self.Trajectory = Trajectory
        self.n = 0
        self.steps = steps

    def lease(self) -> object:
        i = self.n
        self.n += 1
        return self.Lease(attempt_id=f"{i}.1.{i % 999983:06x}", item=i, prompt=i // 8, sample=i % 8, attempt=1,
                          task={}, backend=f"http://10.0.0.{i % 4}:8000", queued_seconds=0.5)

    def work(self) -> object:
        """A result's worth of the controller's other work: its trajectory parsed and dumped."""
        t = self.Trajectory.model_validate_json(self.result)
        t.model_dump_json()
        return t


def _grant(hooks: types.ModuleType, lease: Any) -> None:
    """The grant hook as the product of its revision calls it: this tree's takes the lease's fields and its answer goes
    to the `Lease`'s constructor (here: made already, its fields read); older ones took the lease, their answer
    assigned to it (pydantic validates that: ~3 µs, counted in their hooks' time as in their controller)."""
    node = f"node-{lease.item % 1000}"
    if "grant" in inspect.signature(hooks.granted).parameters:
        hooks.granted(lease.__dict__, "default/bench", node)
    else:
        lease.traceparent = hooks.granted(lease, "default/bench", node)


def _block(world: World, hooks: types.ModuleType | None, open_: list, timer: float) -> dict:
    """`world.steps` steps, each: other work, grant a new attempt, other work, end the oldest open one (`hooks`
    None: tracing off). CPU per step: the hooks' in this thread, the export thread's, the process's."""
    from rolloutd.crds.kit import tracing

    batches = tracing._batches
    tid = batches._thread.native_id
    tracing.flush()
    hook = 0.0
    tt = time.thread_time
    p0, x0, m0 = time.process_time(), _thread_cpu(tid), tt()
    for _ in range(world.steps):
        t = world.work()
        lease = world.lease()
        if hooks is not None:
            t0 = tt()
            _grant(hooks, lease)
            hook += tt() - t0
        open_.append(lease.attempt_id)
        world.work()
        aid = open_.pop(0)
        if hooks is not None:
            t0 = tt()
            hooks.ended(aid, "done", t)
            hook += tt() - t0
    tracing.flush()
    n = world.steps
    return {"hooks": hook / n - (2 * timer if hooks is not None else 0.0), "export": (_thread_cpu(tid) - x0) / n,
            "process": (time.process_time() - p0) / n, "main": (tt() - m0) / n}


def run(quick: bool = False) -> list[dict]:
    from rolloutd.crds.kit import tracing

    rev = os.environ.get("ROLLOUTD_TH_BEFORE", BEFORE)
    inflight = 2000 if quick else int(os.environ.get("ROLLOUTD_TH_INFLIGHT", "20000"))
    steps, rounds = (500, 2) if quick else (2000, int(os.environ.get("ROLLOUTD_TH_ROUNDS", "6")))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    sink = multiprocessing.get_context("fork").Process(target=server.serve_forever, daemon=True)
    sink.start()
    server.socket.close()
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{server.server_port}/v1/traces")
    os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", "200000")   # blocks end attempts faster than a controller: keep all
    thresholds = gc.get_threshold()
    try:
        tracing.setup("bench", True)
        tracer = tracing._tracer
        tracing._batches = tracing._own_batches()
        batches = tracing._batches
        from rolloutd.controller.work import tracing as after
        modes = {"off": None, rev: _module(rev), "this tree": after}
        world = World(inflight, steps)
        opens: dict[str, list] = {m: [] for m in modes}
        for name, hooks in modes.items():   # each mode's attempts in flight, granted before the first block
            tracing._tracer = tracer if hooks is not None else None
            for _ in range(inflight):
                lease = world.lease()
                if hooks is not None:
                    _grant(hooks, lease)
                opens[name].append(lease.attempt_id)
        timer = 0.0
        from rolloutd.controller.server import tune_gc
        tune_gc()   # the controller's collector: start-up frozen, the young generation every 50 000 allocations
        # (undone at the end: `python -m bench` runs other benches in this process)
        for _ in range(100_000):
            a = time.thread_time()
            timer += time.thread_time() - a
        timer /= 100_000
        got: dict[str, list[dict]] = {m: [] for m in modes}
        sent0 = batches.added
        for r in range(rounds):
            for name in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                tracing._tracer = tracer if modes[name] is not None else None
                got[name].append(_block(world, modes[name], opens[name], timer))
        tracing._tracer = tracer
        tracing.flush()
        spans, lost = batches.added - sent0, batches.dropped + batches.failed
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        tracing._tracer = None
        with contextlib.suppress(Exception):
            tracing._provider.shutdown()
        sink.terminate()
        sink.join(5)
    med = {m: {k: statistics.median(b[k] for b in got[m]) * 1e6 for k in ("hooks", "export", "process", "main")}
           for m in modes}
    off = med["off"]["process"]
    rows, ended = [], 2 * rounds * steps   # attempts ended with tracing on (two modes)
    cost = {m: med[m]["hooks"] + med[m]["export"] for m in (rev, "this tree")}
    for m in (rev, "this tree"):
        d = med[m]
        rows.append({"benchmark": f"the controller's tracing per attempt, {m}: hooks on the calling thread + export "
                                  f"thread, CPU ({inflight} open, among a result's other work)",
                     "ours": f"{d['hooks']:.1f} + {d['export']:.1f} = {d['hooks'] + d['export']:.1f} µs",
                     "baseline": f"vs off: process {d['process'] - off:+.1f} µs, calling thread "
                                 f"{d['main'] - med['off']['main']:+.1f} µs (off: {off:.0f} µs per step)",
                     "ratio": d["process"] / off, "target": "less than before (" + rev + ")",
                     "met": None if m == rev else cost[m] < cost[rev]})
    rows.append({"benchmark": "tracing on: spans sent per attempt ended, spans lost", "ours":
                 f"{spans / ended:g}, {lost}", "baseline": "-", "ratio": None,
                 "target": "2, 0", "met": spans == 2 * ended and lost == 0})
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
