"""Burst of INITs: N sandboxes requested at once on one node, side by side with N bare bwraps at once.

Where it sits: run by the bench runner (`python -m bench burst`) through `run(quick)`, or alone as
``python -m bench.bench_burst [--quick] [--n 8,32] [--reps 5]`` (prints its own table and the load).
Rows: ``{benchmark, ours, baseline, ratio, target, met}`` (issue #29, goal 1).

For each N, repetitions alternate four bursts, so each sees the same load on a shared machine:

* **bare**: N ``bwrap --ro-bind / / --unshare-all --die-with-parent true`` started at once (asyncio
  subprocesses); each one's time is from the burst's start to its exit.
* **pool of 2** (before this change): a full `WarmPool` of 2, refilled one at a time; N
  ``acquire()`` + ``bash("true")`` at once; each one's time is from the burst's start to its first
  command answered (2 are warm, the rest cold).
* **first burst** (now): the same with the pool sized from the INIT rate (``most=64``) before it has
  seen any burst: what a job's very first wave on a node gets.
* **a burst the pool has seen**: the same pool after one untimed burst of N and its refill (untimed
  wait until ``idle == target``): a job's later waves (DAPO refills, the next group), the goal's row.

Reported per N: the median over the repetitions of each burst's p95. The ratio is ours ÷ bare in the
same repetition, median over the repetitions. Target ≤ 2.5×. A sandbox that fails to start is counted and
named (stderr, and the row), never timed.
"""
from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time

from rolloutd.sandbox import SandboxSpec, WarmPool, get_runtime

BARE = ["bwrap", "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"]
GOAL = 2.5
MOST = 64
COLD: dict[int, int] = {}    # N → sandboxes of the "seen" bursts that were started cold (the pool had not them)
FAILED: dict[int, int] = {}  # N → sandboxes of its bursts that failed to start (an infra error, not a time)


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))] * 1000


async def bare_burst(n: int) -> list[float]:
    t0 = time.perf_counter()

    async def one() -> float:
        p = await asyncio.create_subprocess_exec(*BARE, stderr=asyncio.subprocess.PIPE)
        _, err = await p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(BARE)} exited {p.returncode}: {err.decode(errors='replace').strip()}")
        return time.perf_counter() - t0

    return list(await asyncio.gather(*(one() for _ in range(n))))


async def pool_burst(pool: WarmPool, n: int) -> list[float]:
    """N acquire + first command at once; every sandbox closed afterwards (untimed)."""
    t0 = time.perf_counter()
    got = []

    async def one() -> float:
        sb = await pool.acquire()
        got.append(sb)
        r = await sb.bash("true")
        if r.exit_code != 0:
            raise RuntimeError(f"bash true in a sandbox: {r}")
        return time.perf_counter() - t0

    try:
        done = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    finally:
        await asyncio.gather(*(sb.close() for sb in got))
    failed = [e for e in done if isinstance(e, BaseException)]
    for e in failed[:1]:
        print(f"   {len(failed)} of {n} sandboxes failed to start, e.g. {type(e).__name__}: {e}", file=sys.stderr)
    FAILED[n] = FAILED.get(n, 0) + len(failed)
    return [t for t in done if not isinstance(t, BaseException)] or [float("inf")]


async def full(pool: WarmPool, want: int, limit: float = 300) -> None:
    pool.start()
    deadline = time.monotonic() + limit
    while pool.idle < want or pool._creating:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pool did not fill to {want} in {limit} s: {dict(pool.stats)}")
        await asyncio.sleep(0.01)


async def one_rep(n: int, order: int) -> dict[str, float]:
    runtime, spec = get_runtime("bwrap"), SandboxSpec()

    async def before() -> float:
        pool = WarmPool(runtime, spec, 2)
        try:
            await full(pool, 2)
            return p95(await pool_burst(pool, n))
        finally:
            await pool.close()

    async def first() -> float:
        pool = WarmPool(runtime, spec, 2, most=MOST)
        try:
            await full(pool, 2)
            return p95(await pool_burst(pool, n))
        finally:
            await pool.close()

    async def seen() -> float:
        pool = WarmPool(runtime, spec, 2, most=MOST)
        try:
            await full(pool, 2)
            await pool_burst(pool, n)            # untimed: the burst the pool learns from
            await full(pool, pool.target)
            before = dict(pool.stats)
            took = p95(await pool_burst(pool, n))
            COLD[n] = COLD.get(n, 0) + pool.stats["cold"] - before.get("cold", 0)  # expired while refilling
            return took
        finally:
            await pool.close()

    async def bare() -> float:
        return p95(await bare_burst(n))

    steps = [("bare", bare), ("before", before), ("first", first), ("seen", seen)]
    if order % 2:
        steps.reverse()
    return {name: await step() for name, step in steps}


def measure(ns: list[int], reps: int) -> tuple[dict[int, list[dict[str, float]]], tuple[float, float]]:
    load0 = os.getloadavg()[0]
    got = {}
    for n in ns:
        got[n] = [asyncio.run(one_rep(n, i)) for i in range(reps)]
        print(f"   N={n}: {got[n]}", file=sys.stderr, flush=True)
    return got, (load0, os.getloadavg()[0])


def rows(got: dict[int, list[dict[str, float]]], load: tuple[float, float]) -> list[dict]:
    out = []
    what = {"before": "pool of 2, refilled one at a time (before)", "first": "first burst, pool sized from the "
            "INIT rate", "seen": "a burst the pool has seen (sized from the INIT rate)"}
    for n, reps in got.items():
        bare = statistics.median(r["bare"] for r in reps)
        for key in ("before", "first", "seen"):
            ratio = statistics.median(r[key] / r["bare"] for r in reps)
            out.append({
                "benchmark": f"burst of {n} at once, p95 ready: {what[key]} ({len(reps)} reps, load "
                             f"{load[0]:.1f}→{load[1]:.1f})",
                "ours": f"p95 {statistics.median(r[key] for r in reps):.0f} ms"
                        + (f" ({FAILED[n]} of all its bursts' sandboxes failed to start)" if FAILED.get(n) else "")
                        + (f" ({COLD[n]} of {n * len(reps)} started cold)" if key == "seen" and COLD.get(n) else ""),
                "baseline": f"{n} bare `bwrap --unshare-all true` at once: p95 {bare:.0f} ms",
                "ratio": round(ratio, 2),
                "target": f"≤ {GOAL}× bare" if key == "seen" else "(reference)",
                "met": ratio <= GOAL if key == "seen" else None,
            })
    return out


def run(quick: bool = False) -> list[dict]:
    got, load = measure([8, 32] if quick else [8, 32, 64], 2 if quick else 5)
    return rows(got, load)


def main() -> None:
    args = sys.argv[1:]
    ns = [int(x) for x in args[args.index("--n") + 1].split(",")] if "--n" in args else None
    reps = int(args[args.index("--reps") + 1]) if "--reps" in args else None
    quick = "--quick" in args
    got, load = measure(ns or ([8, 32] if quick else [8, 32, 64]), reps or (2 if quick else 5))
    print(f"load average (1 min) {load[0]:.2f} → {load[1]:.2f} on {os.cpu_count()} cores")
    from bench.__main__ import render

    print(render(rows(got, load)), end="")


if __name__ == "__main__":
    main()
