"""The warm pool (`rolloutd.sandbox.pool.WarmPool`) with real bwrap sandboxes: fresh sandboxes handed
out once, refilled to size, dead or expired idle ones never handed out, cold creation when empty or
failing, and nothing left in /proc or on disk after close. Every wait is on a condition with a deadline."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from rolloutd.sandbox import SandboxCreateError, SandboxSpec, WarmPool, get_runtime
from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.sandbox.host.footprint import sandbox_base_dir

from support.waiting import until, wait_until

from support.sandbox_checks import host_pids_of, require_bwrap


@pytest.fixture
def base(tmp_path, monkeypatch):
    """A sandbox directory of this test alone (so "nothing left" means nothing at all)."""
    require_bwrap()
    path = tmp_path / "sandboxes"
    monkeypatch.setenv("ROLLOUTD_SANDBOX_DIR", str(path))
    return path


def leftovers(base, ids) -> tuple[list[str], dict[str, list[int]]]:
    """(directories in the sandbox dir, {id: its processes} for the ids that still have some)."""
    dirs = sorted(os.listdir(base)) if base.exists() else []
    pids = {i: host_pids_of(i) for i in ids}
    return dirs, {i: p for i, p in pids.items() if p}


async def warm_pool(spec: SandboxSpec | None = None, **kw) -> WarmPool:
    """A started bwrap pool of 2, once both sandboxes are idle in it."""
    pool = WarmPool(get_runtime("bwrap", SandboxSettings.from_env()), spec or SandboxSpec(), size=2, **kw)
    pool.start()
    await until(lambda: pool.idle == 2, what="the pool warm")
    return pool


def idle_ids(pool: WarmPool) -> list[str]:
    return [sb.id for sb, _ in pool._idle]


def test_warm_sandboxes_are_fresh_distinct_and_the_pool_refills(run, base):
    async def scenario():
        pool = await warm_pool()
        warmed = idle_ids(pool)
        a, b = await pool.acquire(), await pool.acquire()
        try:
            assert {a.id, b.id} == set(warmed) and a.id != b.id and a.workspace != b.workspace
            for sb in (a, b):
                assert sb.alive and os.listdir(sb.workspace) == []
                r = await sb.bash("ls -A; pwd; echo first")
                assert (r.exit_code, r.output) == (0, "/workspace\nfirst\n")
            await a.write_file("mine.txt", "a")
            assert (await b.bash("ls -A")).output == ""          # nothing shared between them
            # the pool refills to its size with new sandboxes (never the ones handed out)
            await until(lambda: pool.idle == 2, what="the pool refilled")
            refilled = idle_ids(pool)
            assert not set(refilled) & {a.id, b.id}
            assert pool.stats["warm"] == 2 and pool.stats["cold"] == 0
            # a pooled sandbox's wall clock started early: it gets the extra idle allowance
            assert a.spec.limits.wall_seconds == pool.spec.limits.wall_seconds + 60 == pool.warm_spec.limits.wall_seconds
        finally:
            await asyncio.gather(a.close(), b.close())
            await pool.close()
        return [*warmed, *refilled]

    ids = run(scenario())
    assert leftovers(base, ids) == ([], {})


def test_an_idle_sandbox_killed_behind_the_pools_back_is_never_handed_out(run, base):
    async def scenario():
        pool = await warm_pool()
        victim = pool._idle[0][0]
        pids = host_pids_of(victim.id)          # its exec server and everything under it
        assert pids
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Wait until they are reaped (gone from /proc, not just dying: a dying process may still hold
        # the server's socket) WITHOUT giving the event loop a turn: the pool's own watch of its idle
        # sandboxes cannot run, so only acquire()'s check can keep the dead one from being handed out.
        wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pids), 10, "the killed processes reaped")
        assert victim.alive                     # as far as the event loop knows, it still is
        got = [await pool.acquire(), await pool.acquire()]
        try:
            assert victim.id not in {sb.id for sb in got}
            for sb in got:
                assert (await sb.bash("echo alive")).output == "alive\n"
            # the pool cleaned the dead one up itself (it was never handed out to be closed)
            await until(lambda: not victim.root.exists(), 10, "the dead sandbox's directory removed")
            assert pool.stats["dead"] == 1
        finally:
            await asyncio.gather(*(sb.close() for sb in got))
            await pool.close()
        return [victim.id, *(sb.id for sb in got)]

    ids = run(scenario())
    assert leftovers(base, ids) == ([], {})


def test_acquire_on_an_empty_pool_creates_cold_and_size_0_is_no_pool(run, base):
    async def scenario():
        pool = WarmPool(get_runtime("bwrap", SandboxSettings.from_env()), SandboxSpec(), size=2)
        sb = await pool.acquire()              # nothing warmed yet: created on the spot
        none = WarmPool(get_runtime("bwrap", SandboxSettings.from_env()), SandboxSpec(), size=0)
        plain = await none.acquire()
        try:
            assert pool.stats["cold"] == 1 and pool.stats["warm"] == 0
            assert sb.spec == pool.spec        # a cold one gets exactly the spec
            assert (await sb.bash("echo cold")).output == "cold\n"
            assert (await plain.bash("echo plain")).output == "plain\n"
            assert none.idle == 0 and none._loop_task is None and none.stats == {"cold": 1}   # counted, never pooled
            await until(lambda: pool.idle == 2, what="the pool warm after a cold acquire")
            ids = [sb.id, plain.id, *idle_ids(pool)]
        finally:
            await asyncio.gather(sb.close(), plain.close())
            await asyncio.gather(pool.close(), none.close())
        return ids

    ids = run(scenario())
    assert leftovers(base, ids) == ([], {})


def test_close_leaves_nothing_even_with_a_creation_in_progress(run, base):
    async def scenario():
        # a full pool
        full = await warm_pool()
        ids = idle_ids(full)
        await full.close()
        assert full.idle == 0
        # a pool closed while its first sandbox is being started: closed once it is up
        busy = WarmPool(get_runtime("bwrap", SandboxSettings.from_env()), SandboxSpec(), size=2)
        busy.start()
        await until(lambda: busy._creating and os.listdir(base), 10, "a creation under way")
        ids += os.listdir(base)
        await asyncio.gather(busy.close(), busy.close())   # twice at once: both wait for the same close
        await busy.close()                                 # and again afterwards
        assert busy.closed and busy.idle == 0 and not busy._creating
        after = leftovers(base, ids)
        # after close, acquire is a plain create (the caller owns the sandbox)
        sb = await busy.acquire()
        try:
            assert (await sb.bash("echo late")).output == "late\n" and busy.idle == 0
        finally:
            await sb.close()
        return ids + [sb.id], after

    ids, after_close = run(scenario())
    assert after_close == ([], {})
    assert leftovers(base, ids) == ([], {})


def test_failing_creations_back_off_and_acquire_raises_the_cold_error(run, base, caplog):
    async def scenario():
        spec = SandboxSpec(image="/nonexistent-rolloutd-rootfs")
        pool = WarmPool(get_runtime("bwrap", SandboxSettings.from_env()), spec, size=2, backoff=(0.05, 0.2))
        pool.start()
        try:
            await until(lambda: pool.stats["failures"] >= 3, 30, "refill retried")
            with pytest.raises(SandboxCreateError, match="nonexistent-rolloutd-rootfs"):
                await pool.acquire()
            assert pool.stats["cold"] == 1 and pool.idle == 0
            assert not pool._loop_task.done()   # the refill goes on trying
        finally:
            await pool.close()

    with caplog.at_level("WARNING", logger="rolloutd.sandbox.pool"):
        run(scenario())
    assert "creating a sandbox failed" in caplog.text and "retrying in" in caplog.text
    assert leftovers(base, []) == ([], {})


def test_idle_sandboxes_older_than_max_idle_are_recycled(run, base):
    async def scenario():
        pool = await warm_pool(SandboxSpec(limits={"wall_seconds": 30}), max_idle=0.5)
        assert pool.warm_spec.limits.wall_seconds == 31 and pool.spec.limits.wall_seconds == 30
        first = idle_ids(pool)
        await until(lambda: pool.idle == 2 and not set(first) & set(idle_ids(pool)), 30, "both recycled")
        await until(lambda: pool.stats["expired"] >= 2 and not any((base / i).exists() for i in first),
                    10, "the old ones closed")
        seen = first + idle_ids(pool)
        await pool.close()
        return seen

    ids = run(scenario())
    assert leftovers(base, ids) == ([], {})
