"""The daemon's leases riding on beat and results replies (`?lease=N`): with a controller that answers them the
leases come that way and every rollout is still reported exactly once; with one that ignores the parameter (an
older controller) the daemon leases by its own calls, as before."""
from __future__ import annotations

import asyncio

import pytest

from support.node_helpers import make_spec, options
from rolloutd.agents.daemon.daemon import NodeDaemon
from support.scripted_tasks import ScriptedTask


@pytest.mark.parametrize("answers", [True, False], ids=["controller answers", "older controller"])
def test_leases_ride_on_replies_when_the_controller_answers_them(controller, sandbox_dir, answers):
    fake = controller(make_spec(workers=(2, 2, 2)))
    fake.piggyback = answers
    fake.add(*[{"id": f"r{i}"} for i in range(6)], samples=2)  # 12 rollouts, 2 at a time

    async def scenario():
        d = NodeDaemon(options(fake), handler=ScriptedTask())
        return d, await asyncio.wait_for(d.run(), 60)

    d, code = asyncio.run(scenario())
    assert code == 0
    assert len(fake.accepted) == 12 and all(n == 1 for n in fake.receipts.values()), fake.receipts
    riding = d.stats["leases_on_beats"] + d.stats["leases_on_results"]
    if answers:
        assert d.leaser.piggyback is True and riding == fake.piggybacked > 0
    else:
        assert d.leaser.piggyback is False and riding == fake.piggybacked == 0
    assert d.leaser.asking == 0  # every ask was answered
