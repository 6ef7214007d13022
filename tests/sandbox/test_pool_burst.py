"""Bursts of INITs against the warm pool (`WarmPool(..., most=...)`) with real bwrap sandboxes: a burst
larger than the pool all starts, each sandbox isolated from the others; the pool then grows to the burst
it saw, never past `most` sandboxes alive, hands the next burst warm sandboxes and shrinks back to its size
once the bursts stop. Every wait is on a condition with a deadline; nothing here is timed."""
from __future__ import annotations

import asyncio

from rolloutd.sandbox import SandboxSpec, WarmPool, get_runtime

from support.waiting import until

from .test_pool import base, idle_ids, leftovers  # noqa: F401 - `base` is a fixture

MARKS = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep '^burst-mark-' | sort -u"


async def settled(pool: WarmPool, idle: int, what: str) -> None:
    """Until the pool holds `idle` idle sandboxes and starts none; then a few loop turns for the refill
    to start more if it (wrongly) would."""
    await until(lambda: pool.idle >= idle and not pool._creating, 60, what)
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_burst_larger_than_the_pool_starts_isolated_sandboxes_and_the_pool_learns_it(run, base):  # noqa: F811
    async def scenario():
        pool = WarmPool(get_runtime("bwrap"), SandboxSpec(), size=2, most=12)
        pool.start()
        await until(lambda: pool.idle == 2, 30, "the pool warm")
        first = await asyncio.gather(*(pool.acquire() for _ in range(8)))   # 8 at once, 2 warm
        seen = [sb.id for sb in first]
        second = []
        try:
            assert len(set(seen)) == 8 and len({sb.workspace for sb in first}) == 8
            assert (pool.stats["warm"], pool.stats["cold"]) == (2, 6)
            for i, sb in enumerate(first):   # each its own files and processes
                await sb.write_file(f"secret-{i}.txt", f"only {i}")
                r = await sb.bash(f"(exec -a burst-mark-{i} sleep 300) & echo started")
                assert r.output == "started\n"
            for i, sb in enumerate(first):
                assert (await sb.bash("ls -A /workspace")).output == f"secret-{i}.txt\n"
                marks = (await sb.bash(MARKS)).output
                assert marks == f"burst-mark-{i}\n", marks
            # the pool now wants 8 idle, but 8 are out and at most 12 may be alive: it warms 4
            assert pool.target == 8
            await settled(pool, 4, "4 warm beside the 8 out")
            assert pool.idle == 4 and pool.held == 12
            await asyncio.gather(*(sb.close() for sb in first))
            await settled(pool, 8, "the pool grown to the burst it saw")
            assert pool.idle == 8 and pool.held == 8
            seen += idle_ids(pool)
            second = await asyncio.gather(*(pool.acquire() for _ in range(8)))   # the next burst: all warm
            assert (pool.stats["warm"], pool.stats["cold"]) == (10, 6)
            for sb in second:
                assert (await sb.bash("ls -A /workspace")).output == ""   # fresh, never used
        finally:
            await asyncio.gather(*(sb.close() for sb in first + second))
            seen += idle_ids(pool)
            await pool.close()
        return seen

    ids = run(scenario(), 300)
    assert leftovers(base, ids) == ([], {})


def test_the_pool_shrinks_back_to_its_size_when_the_bursts_stop_and_a_fixed_pool_never_grows(run, base):  # noqa: F811
    async def burst(pool: WarmPool, n: int) -> list[str]:
        got = await asyncio.gather(*(pool.acquire() for _ in range(n)))
        await asyncio.gather(*(sb.close() for sb in got))
        return [sb.id for sb in got]

    async def scenario():
        learning = WarmPool(get_runtime("bwrap"), SandboxSpec(), size=2, most=16, memory=2.0)
        fixed = WarmPool(get_runtime("bwrap"), SandboxSpec(), size=2)
        seen = []
        try:
            for pool in (learning, fixed):
                pool.start()
                await until(lambda: pool.idle == 2, 30, "the pool warm")
                seen += await burst(pool, 6)
            await until(lambda: learning.idle == 6 and not learning._creating, 60, "grown to 6")
            seen += idle_ids(learning)
            await settled(fixed, 2, "the fixed pool refilled")
            assert fixed.target == 2 and fixed.idle == 2 and fixed.most is None
            # two seconds after the burst the pool forgets it and closes the extra idle sandboxes
            await until(lambda: learning.idle == 2 and learning.stats["shrunk"] == 4, 60, "back to 2")
            assert learning.target == 2
        finally:
            seen += idle_ids(learning) + idle_ids(fixed)
            await asyncio.gather(learning.close(), fixed.close())
        return seen

    ids = run(scenario(), 300)
    assert leftovers(base, ids) == ([], {})
