"""The node-protocol features the daemon asks for at registration (crds.node.FEATURES): with a controller that
serves them, results ride on beats (no POST …/results), beats keep the controller's beatGap, and a beat prompted by
a change names only what changed; a failed or refused beat loses nothing. An older controller, which ignores the
parameter and refuses fields it does not know, gets today's beats and results calls."""
from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

import pytest

from support.fake_controller import FakeController
from support.node_helpers import make_spec, options, until
from rolloutd.agents.daemon import heartbeat
from rolloutd.agents.daemon.daemon import NodeDaemon
from rolloutd.crds.node import BEAT_DELTAS, BEAT_RESULTS, FEATURES, Heartbeat
from rolloutd.crds.trajectory import Trajectory
from support.scripted_tasks import ScriptedTask


def answered(fake: FakeController) -> list[tuple[float, Heartbeat]]:
    with fake.cond:
        return [(t, hb) for t, hb, _, status in fake.beat_log if status == 200]


def told(fake: FakeController) -> dict[str, str]:
    """The stages the controller knows from the answered beats (a full beat restates them all)."""
    stages: dict[str, str] = {}
    for _, hb in answered(fake):
        stages = dict(hb.stages) if hb.full else {**stages, **hb.stages}
    return stages


def aid_of(fake: FakeController, task_id: str) -> str | None:
    return next((lease.attempt_id for lease in fake.lease_log if lease.task.get("id") == task_id), None)


def run_daemon(fake: FakeController, handler: ScriptedTask, steer=None, **opts) -> tuple[NodeDaemon, int]:
    async def scenario():
        d = NodeDaemon(options(fake, **opts), handler=handler)
        run = asyncio.create_task(d.run())
        if steer is not None:
            await steer(d)
        return d, await asyncio.wait_for(run, 60)

    return asyncio.run(scenario())


def test_results_ride_on_paced_beats_and_change_beats_name_only_changes(controller, sandbox_dir, monkeypatch):
    # each wait is `spaced_gap` of the beatGap at a random point: pinned to the middle (the beatGap itself), so the
    # pacing asserted below does not depend on the draws (7 uniform draws averaged under 0.8 of it ~3 % of runs)
    monkeypatch.setattr(heartbeat, "random", SimpleNamespace(random=lambda: 0.5))
    fake = controller(make_spec(workers=(2, 2, 2)), heartbeat_seconds=0.5)
    fake.features, fake.beat_gap, fake.piggyback = FEATURES, 0.25, True
    # each of the others waits in INIT for a gate of its own, so that they change one by one around the held one
    fake.add({"id": "held", "run_gate": "hold"}, *[{"id": f"r{i}", "init_gate": f"g{i}"} for i in range(8)])
    handler = ScriptedTask()

    async def steer(d: NodeDaemon) -> None:
        # the held rollout stays in RUN across timed beats while the others change around it, released one at a
        # time until a change beat has left the (unchanged) held rollout out
        held = await until(lambda: told(fake).get(aid_of(fake, "held")) == "run" and aid_of(fake, "held"), 30,
                           "the held rollout told in RUN")
        since = answered(fake)[-1][0]
        after = lambda: [hb for t, hb in answered(fake) if t > since]  # noqa: E731
        for i in range(8):
            if any(not hb.full and held not in hb.stages for hb in after()) and sum(hb.full for hb in after()) >= 2:
                break
            handler.gate(f"g{i}").set()
            await until(lambda: aid_of(fake, f"r{i}") in fake.accepted, 30, f"r{i} done")
        await until(lambda: sum(hb.full for hb in after()) >= 2, 30, "two timed beats")
        for i in range(8):
            handler.gate(f"g{i}").set()
        handler.gate("hold").set()

    d, code = run_daemon(fake, handler, steer)
    assert code == 0
    assert fake.register_queries == [",".join(FEATURES)]  # with node-token: the node's own token (issue 24)
    assert d.outbox.on_beats and d.heart.deltas
    # every rollout reported exactly once, all on beats: no results call was made
    leases = {lease.attempt_id for lease in fake.lease_log}
    assert len(leases) == 9 and set(fake.accepted) == leases
    assert all(n == 1 for n in fake.receipts.values()), fake.receipts
    assert sorted(fake.results_on_beats) == sorted(leases) and fake.results_calls == 0
    assert d.stats["results_on_beats"] == 9 and not d.outbox.pending and not d.outbox.in_flight
    assert d.leaser.asking == 0  # every lease ask (on a beat or by a long-poll) was answered

    beats = answered(fake)
    assert all(status == 200 for *_, status in fake.beat_log)
    # the controller's beatGap (0.25 s, not the 0.1 s of a 0.5 s interval) holds from its first reply on: every
    # beat after the first is sent at least 0.25 s after the one before; measured where the fake receives them,
    # on average over the run and over four gaps at a time (a beat received late, on a busy test machine,
    # shortens the gap after it)
    times = [t for t, _ in beats][1:]  # the run takes 3 or more of them: RUN told, then two timed beats
    assert len(times) >= 3 and (times[-1] - times[0]) / (len(times) - 1) > 0.25 * 0.8, times
    k = min(4, len(times) - 1)
    assert min(b - a for a, b in zip(times, times[k:])) > k * 0.25 - 0.3, times

    held, stages, seen = aid_of(fake, "held"), None, set()
    fulls, deltas, held_left_out = [], [], 0
    for (t, hb, live, _) in fake.beat_log:
        known_live = seen & live   # attempts the daemon has named and the controller still leases to it
        if hb.full:
            assert known_live <= set(hb.stages) <= live, (known_live, hb.stages)
            stages = dict(hb.stages)
            fulls.append(t)
        else:
            assert stages is not None, "the first beat is full"
            assert all(stages.get(aid) != stage for aid, stage in hb.stages.items()), (stages, hb.stages)
            stages.update(hb.stages)
            deltas.append(hb)
            held_left_out += held in known_live and held not in hb.stages
        seen |= set(hb.stages)
    assert len(fulls) >= 3 and any(hb.stages for hb in deltas) and held_left_out > 0
    assert (d.stats["full_beats"], d.stats["delta_beats"]) == (len(fulls), len(deltas))
    # timed beats renew the leases every interval (generous scheduling tolerance)
    assert max(b - a for a, b in itertools.pairwise(fulls)) < 3 * 0.5, fulls


@pytest.mark.parametrize("served", [(), (BEAT_RESULTS,), (BEAT_DELTAS,)], ids=["older", "results only", "deltas only"])
def test_a_controller_gets_only_the_fields_of_the_features_it_serves(controller, sandbox_dir, served):
    """An older controller ignores `?features=` and refuses a body field it does not know (422): the daemon sends
    beats and results calls as before; one serving a single feature gets only that feature's field."""
    fake = controller(make_spec(workers=(2, 2, 2)))
    fake.features = served
    fake.add(*[{"id": f"o{i}"} for i in range(6)])

    d, code = run_daemon(fake, ScriptedTask())
    assert code == 0
    assert fake.register_queries == [",".join(FEATURES)]   # asked either way
    assert (d.outbox.on_beats, d.heart.deltas) == (BEAT_RESULTS in served, BEAT_DELTAS in served)
    assert len(fake.accepted) == 6 and all(n == 1 for n in fake.receipts.values()), fake.receipts
    assert d.stats["heartbeat_failures"] == 0 and all(status == 200 for *_, status in fake.beat_log)
    sent = set().union(*fake.beat_fields)
    assert ("results" in sent) == (BEAT_RESULTS in served) and ("full" in sent) == (BEAT_DELTAS in served)
    assert "llmTokens" not in sent and not d.gate.tokens.served  # token-share not served: no field, no cap
    assert "llmProcessed" not in sent and not d.gate.rates.served  # work-share not served: no field, no limit
    if BEAT_RESULTS in served:
        assert fake.results_calls == 0 and d.stats["results_on_beats"] == 6
    else:
        assert fake.results_calls >= 1 and not fake.results_on_beats and d.stats["results_on_beats"] == 0
    if BEAT_DELTAS not in served:   # every beat names every live lease, as today
        assert d.stats["full_beats"] == d.stats["delta_beats"] == 0


def test_a_failed_beat_loses_no_result_and_no_stage_change(controller, sandbox_dir):
    """503 on the beat that first tells B is in EVAL, then on the one that first carries A's result: the next
    beats carry them again (timed beats are 5 s apart, so these are change-prompted beats)."""
    fake = controller(make_spec(workers=(2, 2, 2)), heartbeat_seconds=5.0)
    fake.features, fake.beat_gap = FEATURES, 0.05
    fake.add({"id": "A", "eval_gate": "a"}, {"id": "B", "run_gate": "b", "eval_gate": "b-eval"})
    handler = ScriptedTask()
    failed: list[Heartbeat] = []

    def fail_once(condition):
        def refuse(hb: Heartbeat) -> int | None:
            if condition(hb):
                fake.fail_beat = None
                failed.append(hb)
                return 503
            return None
        return refuse

    async def steer(d: NodeDaemon) -> None:
        await until(lambda: "A" in handler.evals and "B" in handler.ran, 30, "A in EVAL, B in RUN")
        a, b = aid_of(fake, "A"), aid_of(fake, "B")
        await until(lambda: told(fake).get(a) == "eval" and told(fake).get(b) == "run", 10, "both told")
        fake.fail_beat = fail_once(lambda hb: hb.stages.get(b) == "eval")
        handler.gate("b").set()
        await until(lambda: len(failed) == 1, 10, "the beat telling B's EVAL refused")
        fake.fail_beat = fail_once(lambda hb: any(r.attempt_id == a for r in hb.results))
        handler.gate("a").set()
        await until(lambda: len(failed) == 2, 10, "the beat carrying A's result refused")
        handler.gate("b-eval").set()   # B's result prompts the next beat

    d, code = run_daemon(fake, handler, steer)
    assert code == 0
    a, b = aid_of(fake, "A"), aid_of(fake, "B")
    assert [a in {r.attempt_id for r in hb.results} for hb in failed] == [False, True]
    # the beat after each refusal carries what the refused one did
    log = fake.beat_log
    for refused in failed:
        i = next(i for i, (_, hb, _, status) in enumerate(log) if hb is refused)
        after = next(hb for _, hb, _, status in log[i + 1:] if status == 200)
        assert {k: v for k, v in refused.stages.items() if k == b} == {k: v for k, v in after.stages.items() if k == b}
        assert {r.attempt_id for r in refused.results} <= {r.attempt_id for r in after.results}
    assert set(fake.accepted) == {a, b} and fake.receipts == {a: 1, b: 1}
    assert fake.results_calls == 0 and d.stats["heartbeat_failures"] == 2 and d.stats["delta_beats"] > 0
    assert Trajectory.model_validate(fake.accepted[a]).reward == 1.0


def test_a_beat_refused_as_too_large_sends_its_results_by_results_calls(controller, sandbox_dir):
    fake = controller(make_spec(workers=(2, 2, 2)))
    fake.features, fake.max_beat_body = FEATURES, 40_000
    fake.add({"id": "big", "pad": 60_000}, *[{"id": f"s{i}"} for i in range(3)])

    d, code = run_daemon(fake, ScriptedTask())
    assert code == 0
    big = aid_of(fake, "big")
    assert len(fake.accepted) == 4 and all(n == 1 for n in fake.receipts.values()), fake.receipts
    assert 413 in [status for *_, status in fake.beat_log] and fake.results_calls >= 1
    assert big not in fake.results_on_beats and d.stats["results_off_beats"] >= 1
    t = Trajectory.model_validate(fake.accepted[big])   # the result itself, not a stand-in
    assert t.failure.kind.value == "none" and t.reward == 1.0
    assert fake.beat_log[-1][3] == 200 and not d.outbox.pending


def test_a_result_over_the_byte_cap_never_rides_on_a_beat(controller, sandbox_dir):
    fake = controller(make_spec(workers=(2, 2, 2)))
    fake.features = FEATURES
    fake.add({"id": "big", "pad": 60_000}, *[{"id": f"s{i}"} for i in range(3)])

    d, code = run_daemon(fake, ScriptedTask(), result_batch_bytes=30_000)
    assert code == 0
    big = aid_of(fake, "big")
    assert len(fake.accepted) == 4 and all(n == 1 for n in fake.receipts.values()), fake.receipts
    assert fake.results_calls == 1 and fake.batch_sizes[0][0] == 1 and big not in fake.results_on_beats
    assert sorted(fake.results_on_beats) == sorted(set(fake.accepted) - {big})


def test_a_beat_names_turns_only_to_a_controller_serving_beat_turns():
    import json

    from rolloutd.agents.daemon.beatbody import beat_body

    hb = Heartbeat(stages={"1.1.aaaaaa": "run"}, turns={"1.1.aaaaaa": 2})
    assert json.loads(beat_body(hb, [], deltas=True, turns=True))["turns"] == {"1.1.aaaaaa": 2}
    assert "turns" not in json.loads(beat_body(hb, [], deltas=True))  # a controller of before: no field it refuses
