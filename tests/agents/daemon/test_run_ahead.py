"""A full RUN pool keeps rollouts initialised and waiting ahead of it (the node daemon in-process against the fake
controller, real bwrap sandboxes): when a RUN slot frees, the next rollout's lease and INIT are already done, so
the engine does not sit idle through a lease round trip and a sandbox start. Bounded by the INIT pool's size."""
from __future__ import annotations

import asyncio
import collections

from support.node_helpers import make_spec, until
from rolloutd.agents.daemon.rollouts import Phase
from support.scripted_tasks import ScriptedTask
from .test_daemon import daemon

AHEAD = (Phase.LEASED, Phase.INIT, Phase.WAIT_RUN)


def test_a_full_run_pool_has_an_init_pools_worth_of_rollouts_ready(controller, sandbox_dir):
    fake = controller(make_spec(workers=(2, 2, 2)))
    fake.add(*[{"id": f"r{i}", "run_gate": "hold"} for i in range(7)])
    handler = ScriptedTask()

    async def scenario():
        d = daemon(fake, handler)
        run = asyncio.create_task(d.run())

        def counts() -> collections.Counter:
            return collections.Counter(r.phase for r in d.rollouts.live.values())

        # RUN is held: two rollouts in it, and two more leased, initialised (sandbox up) and waiting for a slot
        await until(lambda: counts()[Phase.RUN] == 2 and counts()[Phase.WAIT_RUN] == 2, 30,
                    "2 rollouts in RUN and 2 ready behind them")
        handler.gate("hold").set()
        return d, await asyncio.wait_for(run, 60)

    d, code = asyncio.run(scenario())
    assert code == 0 and len(fake.accepted) == 7
    # at no moment more than the RUN pool in RUN, nor more than the INIT pool's worth ahead of it
    phase: dict[str, str] = {}
    for _, aid, p in d.rollouts.transitions:
        phase[aid] = p
        now = collections.Counter(phase.values())
        assert now[Phase.RUN] <= 2, now
        assert sum(now[p] for p in AHEAD) <= 2, now
