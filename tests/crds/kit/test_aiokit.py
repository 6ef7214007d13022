"""The shared waiting kits: back-off delays and wait-with-timeout."""
import asyncio

from rolloutd.crds.kit.aiokit import Backoff, backoff_delay, wait_event


def test_backoff_delay_grows_to_its_cap_after_free_retries():
    delays = [backoff_delay(n, initial=1.0, maximum=8.0, free=1) for n in range(0, 7)]
    assert delays == [0.0, 0.0, 1.0, 2.0, 4.0, 8.0, 8.0]


def test_backoff_jitters_around_the_delay_and_resets():
    b = Backoff(0.2, 1.0, jitter=0.25)
    got = [b.next() for _ in range(5)]
    for d, base in zip(got, [0.2, 0.4, 0.8, 1.0, 1.0]):
        assert 0.75 * base <= d <= 1.25 * base
    b.reset()
    assert b.next() <= 0.25


def test_wait_event_reports_set_or_timeout():
    async def go():
        ev = asyncio.Event()
        assert await wait_event(ev, 0) is False
        assert await wait_event(ev, 0.01) is False
        asyncio.get_running_loop().call_soon(ev.set)
        assert await wait_event(ev, 5) is True
        assert await wait_event(ev, None) is True
    asyncio.run(go())
