"""Beats back off while the controller refuses them: a daemon whose stages keep changing (each change wakes the
beat loop) does not beat at its change pace against a controller that is away, and delivers everything once it is
back. The real daemon against the fake controller (support/fake_controller.py), its beats refused 503."""
from __future__ import annotations

import asyncio
import time

from support.fake_controller import FakeController
from support.node_helpers import make_spec, options, until
from rolloutd.agents.daemon.daemon import NodeDaemon
from support.scripted_tasks import ScriptedTask

REFUSED_SECONDS = 4.0


def test_beats_back_off_while_the_controller_refuses_them(controller, sandbox_dir):
    """Interval 2 s, so changes may prompt a beat every 0.4 s: ~10 beats in the 4 s window without a back-off;
    with it (0.2, 0.4, 0.8, 1.6 s, jittered, capped at the interval) at most 6. A loaded machine only stretches
    the gaps, so the bound never fails for lack of time."""
    fake: FakeController = controller(make_spec(workers=(2, 2, 2)), heartbeat_seconds=2.0)
    fake.add({"id": "held", "run_gate": "hold"})
    handler = ScriptedTask()

    async def steer(d: NodeDaemon) -> None:
        await until(lambda: "held" in handler.ran, 30, "the rollout in RUN")
        fake.fail_beat = lambda hb: 503
        start = time.monotonic()
        while time.monotonic() - start < REFUSED_SECONDS:
            d.heart.wake.set()  # a stream of stage changes
            await asyncio.sleep(0.02)
        fake.fail_beat = None
        handler.gate("hold").set()

    async def scenario():
        d = NodeDaemon(options(fake, retry_max=5.0), handler=handler)
        run = asyncio.create_task(d.run())
        await steer(d)
        return await asyncio.wait_for(run, 60)

    assert asyncio.run(scenario()) == 0
    refused = [t for t, _, _, status in fake.beat_log if status == 503]
    assert 2 <= len(refused) <= 6, [round(b - a, 2) for a, b in zip(refused, refused[1:])]
    assert len(fake.accepted) == 1 and set(fake.receipts.values()) == {1}
