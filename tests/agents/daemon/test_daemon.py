"""The node daemon in-process (`NodeDaemon` with seams: scripted handler, scripted LLMs) against
the fake controller, with real bwrap sandboxes. See test_sigterm.py for the `rolloutd node`
subprocess."""
from __future__ import annotations

import asyncio
import math
import os
from collections import Counter

import pytest

from support.fake_controller import FakeController
from support.node_helpers import make_spec, options, sandbox_pids, until
from rolloutd.agents.daemon.daemon import SAME_SIGNAL_SECONDS, NodeDaemon, Shutdown
from rolloutd.agents.daemon.supervise import EXIT_REFUSED
from rolloutd.crds.trajectory import Trajectory
from support.scripted_tasks import BlockingLLM, FreshEvalTask, ReplyLLM, ScriptedTask


def daemon(fake: FakeController, handler: ScriptedTask, llm=None, tokenizer=None, **opts) -> NodeDaemon:
    return NodeDaemon(options(fake, **opts), handler=handler, tokenizer=tokenizer,
                      llm_factory=(lambda url: llm) if llm is not None else None)


def phases(d: NodeDaemon, phase: str) -> dict[str, float]:
    """attemptId → time it entered `phase` (first time)."""
    out: dict[str, float] = {}
    for t, aid, p in d.rollouts.transitions:
        if p == phase:
            out.setdefault(aid, t)
    return out


def max_concurrent(intervals: list[tuple[float, float]]) -> int:
    points = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = cur = 0
    for _, step in points:
        cur += step
        best = max(best, cur)
    return best


def intervals(d: NodeDaemon, start: str, ends: tuple[str, ...]) -> list[tuple[float, float]]:
    began: dict[str, float] = {}
    out = []
    for t, aid, p in d.rollouts.transitions:
        if p == start:
            began[aid] = t
        elif p in ends and aid in began:
            out.append((began.pop(aid), t))
    return out


# ------------------------------------------------------------------------------------- (1)
def test_every_lease_reported_once_with_attempt_timings_and_node(controller, sandbox_dir, tokenizer):
    """Six rollouts through the real agent loop (scripted LLM, real tokenizer, real sandboxes):
    each reported exactly once under its attempt id, with the lease's data and per-stage timings."""
    fake = controller(make_spec(workers=(2, 2, 2)))
    fake.add(*[{"id": f"t{i}", "mode": "loop", "question": f"What is {i} + {i}?"} for i in range(3)], samples=2)
    handler, llm = ScriptedTask(), ReplyLLM(tokenizer)

    async def scenario():
        d = daemon(fake, handler, llm, tokenizer, name="gpu-node-7", slot=3)
        code = await asyncio.wait_for(d.run(), 60)
        return d, code

    d, code = asyncio.run(scenario())
    assert code == 0
    assert fake.deregistered == 1
    reg = fake.registers[0]
    assert (reg.name, reg.slot, reg.pid, reg.job) == ("gpu-node-7", 3, os.getpid(), "demo")
    assert fake.register_headers[0]["authorization"] == "Bearer join-secret"

    leases = {lease.attempt_id: lease for lease in fake.lease_log}
    assert len(leases) == 6 and set(fake.accepted) == set(leases)
    assert all(n == 1 for n in fake.receipts.values()), fake.receipts
    for aid, wire in fake.accepted.items():
        lease, t = leases[aid], Trajectory.model_validate(wire)
        assert (t.prompt, t.sample, t.attempt) == (lease.prompt, lease.sample, lease.attempt)
        assert (t.node, t.backend, t.policy_version, t.job) == ("gpu-node-7", fake.backend, 7, "demo")
        assert t.task_id == lease.task["id"]
        assert t.failure.kind.value == "none" and t.reward == 1.0 and t.reward_details["checked"]
        assert t.timings.queue == lease.queued_seconds
        assert t.timings.init > 0 and t.timings.run > 0 and t.timings.eval > 0
        st = t.timings.stamps   # wall-clock stage starts: ordered, durations consistent
        assert st["init"] < st["run"] < st["eval"] < st["end"]
        assert st["run"] - st["init"] >= t.timings.init and st["end"] - st["eval"] >= t.timings.eval
        # the real loop ran: prompt from the chat template, generated ids masked in
        assert t.prompt_length > 0 and sum(t.loss_mask) == len(t.token_ids) - t.prompt_length
        assert t.metrics["turns"] == 1
    # the sandbox made in INIT is the one RUN and EVAL used; every sandbox is gone
    assert len(handler.chains) == 6
    for chain in handler.chains.values():
        assert chain["init"] and chain["init"] == chain["run"] == chain["eval"]
    assert list(sandbox_dir.iterdir()) == []
    # the seeds and limits of the spec reached the loop
    assert len(llm.request_ids) == 6 and not llm.aborted
    # every attempt that ran was reported as having left RUN (the controller frees its backend slot)
    left = {aid for hb in fake.heartbeats for aid in hb.left_run}
    assert left == set(leases)


# ------------------------------------------------------------------------------------- (2)
def test_slow_eval_does_not_stop_run(controller, sandbox_dir):
    """EVAL pool of 1 held by a slow evaluation: RUN keeps taking new rollouts meanwhile."""
    fake = controller(make_spec(workers=(2, 2, 1)))
    fake.add(*[{"id": f"s{i}", "eval_gate": "slow"} for i in range(6)])
    handler = ScriptedTask()

    async def scenario():
        d = daemon(fake, handler)
        run = asyncio.create_task(d.run())

        def runs_during_first_eval() -> int:
            evals = phases(d, "eval")
            if not evals:
                return 0
            first = min(evals.values())
            return sum(1 for t in phases(d, "run").values() if t > first)

        # the first EVAL blocks until three other rollouts have STARTED RUN after it began
        await until(lambda: runs_during_first_eval() >= 3, 30, "RUN starts while EVAL is busy")
        assert len(handler.evals) == 1  # EVAL is still held by the first rollout
        handler.gate("slow").set()
        code = await asyncio.wait_for(run, 60)
        return d, code

    d, code = asyncio.run(scenario())
    assert code == 0 and len(fake.accepted) == 6
    # measured from the recorded stage timestamps: the daemon's transitions ...
    (first_start, first_end) = min(handler.evals.values())
    run_starts = phases(d, "run")
    overlapping = [aid for aid, t in run_starts.items() if first_start < t < first_end]
    assert len(overlapping) >= 3, (first_start, first_end, run_starts)
    assert max_concurrent([tuple(v) for v in handler.evals.values()]) == 1
    # ... and the wall-clock stamps every trajectory carries (what a trainer-side analysis sees)
    stamps = [Trajectory.model_validate(w).timings.stamps for w in fake.accepted.values()]
    first = min(stamps, key=lambda st: st["eval"])
    assert sum(1 for st in stamps if first["eval"] < st["run"] < first["end"]) >= 3
    assert max_concurrent(intervals(d, "run", ("wait_eval",))) <= 2
    assert max_concurrent(intervals(d, "init", ("wait_run",))) <= 2


def test_a_stalled_eval_pool_holds_new_work_back_at_init_run_and_eval_workers(controller, sandbox_dir):
    """EVAL held: RUN goes on until an INIT and a RUN pool's worth of rollouts wait for EVAL, then the node leases
    nothing more: its rollouts, a sandbox each, are at most init + run + eval (before, they piled up without bound,
    every queued item leased and its sandbox kept)."""
    fake = controller(make_spec(workers=(2, 2, 1)))
    fake.add(*[{"id": f"h{i}", "eval_gate": "held"} for i in range(12)])
    handler = ScriptedTask()

    async def scenario():
        d = daemon(fake, handler)
        run = asyncio.create_task(d.run())

        def settled() -> bool:  # every live rollout in EVAL or waiting for it, and no room: nothing more will come
            # The rollouts' own room, not the pipeline's: while the first wave is paced to the warm pool (a loaded
            # machine creates its sandboxes slowly) the pipeline's room is 0 for a moment with one rollout leased.
            live = [r.phase.value for r in d.rollouts.live.values()]
            return len(fake.lease_log) > 5 or (d.rollouts.room(2, 2) == 0 and live != []
                                           and set(live) <= {"eval", "wait_eval"})
        await until(settled, 30, "the node settled with EVAL held")
        leased = len(fake.lease_log)
        handler.gate("held").set()
        return d, leased, await asyncio.wait_for(run, 60)

    d, leased, code = asyncio.run(scenario())
    assert leased == 2 + 2 + 1, leased
    assert code == 0 and len(fake.accepted) == 12
    assert max_concurrent(intervals(d, "init", ("eval",))) <= 2 + 2  # never more than init + run on the way to EVAL


# ------------------------------------------------------------------------------------- (3)
def test_controller_cancel_kills_sandbox_aborts_llm_and_reports_nothing(controller, sandbox_dir):
    fake = controller(make_spec(workers=(2, 1, 1)))
    fake.add({"id": "victim", "llm": True}, {"id": "after-1"}, {"id": "after-2"})
    handler, llm = ScriptedTask(), BlockingLLM()

    async def scenario():
        d = daemon(fake, handler, llm)
        run = asyncio.create_task(d.run())
        await until(lambda: llm.started, 30, "the victim's LLM request in flight")
        victim = fake.lease_of("victim").attempt_id
        sandbox = handler.sandboxes["victim"]
        assert sandbox.root.exists() and sandbox_pids(sandbox.id)
        fake.cancel(victim)
        await until(lambda: llm.aborted, 10, "the in-flight request aborted")
        await until(lambda: not sandbox.root.exists() and not sandbox_pids(sandbox.id), 10, "the sandbox gone")
        code = await asyncio.wait_for(run, 60)
        return d, code, victim, sandbox

    d, code, victim, sandbox = asyncio.run(scenario())
    assert code == 0
    assert llm.aborted == llm.started == ["req-victim"]
    assert victim in fake.cancelled and victim not in fake.receipts
    # its RUN slot was freed: the two rollouts after it (RUN pool of 1) ran and were reported
    assert {Trajectory.model_validate(w).task_id for w in fake.accepted.values()} == {"after-1", "after-2"}
    assert d.stats["cancels"] == 1 and d.stats["aborts"] == 1
    assert list(sandbox_dir.iterdir()) == []


# ------------------------------------------------------------------------------------- (5)
def test_init_failure_is_infra_never_a_reward(controller, sandbox_dir):
    """The sandbox image does not exist: INIT fails, RUN never runs, reported infra, reward None."""
    fake = controller(make_spec(sandbox={"image": "/nonexistent/rootfs"}))
    fake.add({"id": "a"}, {"id": "b"})
    handler = ScriptedTask()

    code = asyncio.run(asyncio.wait_for(daemon(fake, handler).run(), 60))
    assert code == 0 and len(fake.accepted) == 2
    for wire in fake.accepted.values():
        t = Trajectory.model_validate(wire)
        assert t.failure.kind.value == "infra" and t.reward is None
        assert "INIT" in t.failure.reason and "/nonexistent/rootfs" in t.failure.reason
        assert t.node == "node-a" and t.attempt == 1 and t.timings.run == 0
    assert handler.ran == []
    assert list(sandbox_dir.iterdir()) == []


def test_init_timeout_during_sandbox_start_leaves_nothing_behind(controller, sandbox_dir):
    """INIT's deadline expires while the sandbox is still starting: infra, and the sandbox is
    closed once it is up (a start-up cut half-way would leave its directory behind). No warm pool:
    every INIT starts its sandbox cold."""
    fake = controller(make_spec(timeouts={"initSeconds": 0.001}, sandbox={"warm": 0}))
    fake.add({"id": "a"}, {"id": "b"}, {"id": "c"})
    code = asyncio.run(asyncio.wait_for(daemon(fake, ScriptedTask()).run(), 60))
    assert code == 0 and len(fake.accepted) == 3
    for wire in fake.accepted.values():
        t = Trajectory.model_validate(wire)
        assert t.failure.kind.value == "infra" and t.reward is None
        assert t.failure.reason == "INIT exceeded 0.001s"
    assert list(sandbox_dir.iterdir()) == []


def test_eval_crash_is_infra_agent_failure_is_scored(controller, sandbox_dir):
    fake = controller(make_spec(timeouts={"evalSeconds": 1.5}))
    fake.add({"id": "harness", "eval_error": "EvalError"}, {"id": "bug", "eval_error": "crash"},
             {"id": "died", "eval_error": "sandbox"}, {"id": "slow", "eval_gate": "never"},
             {"id": "stage", "init_fail": True}, {"id": "no-answer", "agent_fail": True}, {"id": "ok"})
    handler = ScriptedTask()

    code = asyncio.run(asyncio.wait_for(daemon(fake, handler).run(), 60))
    assert code == 0
    by_task = {t.task_id: t for t in (Trajectory.model_validate(w) for w in fake.accepted.values())}
    assert set(by_task) == {"harness", "bug", "died", "slow", "stage", "no-answer", "ok"}
    for tid, reason in [("harness", "EvalError"), ("bug", "ZeroDivisionError"), ("died", "SandboxDied"),
                        ("slow", "EVAL exceeded 1.5s"), ("stage", "INIT: RuntimeError")]:
        t = by_task[tid]
        assert t.failure.kind.value == "infra" and t.reward is None, tid
        assert reason in t.failure.reason, (tid, t.failure.reason)
    # the policy's own failure goes through EVAL and is a legitimate reward
    assert by_task["no-answer"].failure.kind.value == "agent" and by_task["no-answer"].reward == 0.0
    assert by_task["ok"].reward == 1.0
    assert by_task["slow"].timings.eval >= 1.5
    assert list(sandbox_dir.iterdir()) == []


def test_config_failures_skip_eval_and_are_reported_unscored(controller, sandbox_dir, tokenizer):
    """A handler rejecting its configuration in INIT, and a prompt longer than maxTotalTokens in
    the real agent loop: reported as `config` with no reward, EVAL never runs, nothing is retried."""
    fake = controller(make_spec(agent={"maxTurns": 2, "tools": ["bash"],
                                       "sampling": {"maxTokensPerTurn": 4, "maxTotalTokens": 8}}))
    fake.add({"id": "cfg", "init_config": True}, {"id": "long", "mode": "loop"}, {"id": "fine"})
    handler, llm = ScriptedTask(), ReplyLLM(tokenizer)
    code = asyncio.run(asyncio.wait_for(daemon(fake, handler, llm=llm, tokenizer=tokenizer).run(), 60))
    assert code == 0
    by_task = {t.task_id: t for t in (Trajectory.model_validate(w) for w in fake.accepted.values())}
    assert by_task["cfg"].failure.kind.value == "config" and by_task["cfg"].reward is None
    assert by_task["cfg"].failure.reason.startswith("spec.tasks.source: ")
    assert by_task["long"].failure.kind.value == "config" and by_task["long"].reward is None
    assert by_task["long"].failure.reason.startswith("spec.agent.sampling.maxTotalTokens: the prompt of task long has")
    assert llm.request_ids == []  # nothing was sent to the backend
    assert set(handler.evals) == {"fine"} and by_task["fine"].reward == 1.0
    assert list(sandbox_dir.iterdir()) == []


# ------------------------------------------------------------------------------------- (6)
def test_results_survive_503_and_a_lost_reply(controller, sandbox_dir):
    fake = controller(make_spec())
    # two refusals (never seen), then one accepted whose reply is lost: the daemon resends, the
    # controller's attemptId dedup drops the copy, the daemon forgets it
    fake.results_script = [503, 503, "lose"]
    fake.say_unknown = False   # else a heartbeat may tell the daemon to forget it before it resends
    fake.add({"id": "r0"})

    async def scenario():
        d = daemon(fake, ScriptedTask())
        return d, await asyncio.wait_for(d.run(), 60)

    d, code = asyncio.run(scenario())
    assert code == 0
    (aid,) = [lease.attempt_id for lease in fake.lease_log]
    assert list(fake.accepted) == [aid]
    assert fake.receipts[aid] == 2          # the lost reply's copy, dropped as a duplicate
    assert fake.results_calls == 4
    assert d.stats["result_failures"] == 3 and d.stats["results_dropped"] == 1
    assert not d.outbox.pending


def test_results_survive_the_controller_being_down(controller, sandbox_dir):
    fake = controller(make_spec())
    fake.add({"id": "during-outage", "eval_gate": "go"})
    handler = ScriptedTask()

    async def scenario():
        d = daemon(fake, handler)
        run = asyncio.create_task(d.run())
        await until(lambda: "during-outage" in handler.evals, 30, "EVAL started")
        await asyncio.to_thread(fake.stop)               # the controller goes away
        handler.gate("go").set()
        await until(lambda: d.stats["result_failures"] >= 2, 20, "the daemon failing to deliver")
        assert fake.accepted == {} and d.outbox.pending
        await asyncio.to_thread(fake.start)              # ... and comes back on the same port
        code = await asyncio.wait_for(run, 30)
        return d, code

    d, code = asyncio.run(scenario())
    assert code == 0
    (aid,) = [lease.attempt_id for lease in fake.lease_log]
    assert list(fake.accepted) == [aid] and fake.receipts[aid] == 1
    assert Trajectory.model_validate(fake.accepted[aid]).reward == 1.0


def test_large_results_are_split_and_an_oversized_one_is_refused_alone(controller, sandbox_dir):
    """The controller caps request bodies: results are batched by bytes, a batch refused as too
    large (413) is resent one by one; a result that alone is too large is replaced by an infra
    failure for its attempt (so the controller retries or gives up the item; never stuck leased)."""
    fake = controller(make_spec(workers=(4, 4, 4)))
    fake.max_body = 150_000
    fake.add(*[{"id": f"m{i}", "pad": 60_000, "eval_gate": "all"} for i in range(3)],
             {"id": "huge", "pad": 400_000, "eval_gate": "all"})
    handler = ScriptedTask()

    async def scenario():
        # a wide coalescing window: the four results, finished together, go out as one batch
        d = daemon(fake, handler, result_coalesce=0.3, result_batch_bytes=4 << 20)
        run = asyncio.create_task(d.run())
        await until(lambda: len(handler.evals) == 4, 30, "all four in EVAL")
        handler.gate("all").set()
        return d, await asyncio.wait_for(run, 30)

    d, code = asyncio.run(scenario())
    assert code == 0
    got = {t.task_id: t for t in (Trajectory.model_validate(w) for w in fake.accepted.values())}
    assert set(got) == {"m0", "m1", "m2", "huge"} and all(n == 1 for n in fake.receipts.values())
    stub = got["huge"]
    huge = fake.lease_of("huge")
    assert (stub.prompt, stub.sample, stub.attempt) == (huge.prompt, huge.sample, huge.attempt)
    assert stub.failure.kind.value == "infra" and stub.reward is None and "413" in stub.failure.reason
    assert huge.attempt_id in fake.accepted
    assert fake.batch_sizes[0][0] == 4                        # one batch of four: too large ...
    assert sorted(n for n, _ in fake.batch_sizes[1:]) == [1, 1, 1, 1, 1]   # ... one by one, + the stand-in
    assert d.stats["results_refused"] == 1 and not d.outbox.pending


def test_a_result_the_controller_refuses_takes_no_other_result_of_its_batch_with_it(controller, sandbox_dir):
    """A results call refused for good (422: one result the controller cannot take) is resent one by one: only that
    result becomes an infrastructure failure; the others of its batch are delivered as they were, scored."""
    fake = controller(make_spec(workers=(4, 4, 4)))
    fake.refuse_tasks = {"bad"}
    fake.add(*[{"id": f"ok{i}", "eval_gate": "all"} for i in range(3)], {"id": "bad", "eval_gate": "all"})
    handler = ScriptedTask()

    async def scenario():
        d = daemon(fake, handler, result_coalesce=0.3)  # finished together: one batch of four
        run = asyncio.create_task(d.run())
        await until(lambda: len(handler.evals) == 4, 30, "all four in EVAL")
        handler.gate("all").set()
        return d, await asyncio.wait_for(run, 30)

    d, code = asyncio.run(scenario())
    assert code == 0
    got = {t.task_id: t for t in (Trajectory.model_validate(w) for w in fake.accepted.values())}
    assert {k: (t.failure.kind.value, t.reward) for k, t in got.items()} == {
        "ok0": ("none", 1.0), "ok1": ("none", 1.0), "ok2": ("none", 1.0), "bad": ("infra", None)}
    assert "422" in got["bad"].failure.reason and d.stats["results_refused"] == 1
    assert fake.batch_sizes[0][0] == 4 and not d.outbox.pending


def test_result_batches_are_capped_by_bytes(controller):
    from rolloutd.agents.daemon.outbox import Outgoing

    d = NodeDaemon(options(controller(make_spec()), result_batch_bytes=1000, result_batch=3))
    def out(n: int, c: bytes = b"x"):
        return Outgoing(c * n, lease=None)

    d.outbox.pending = {f"a{i}": out(300) for i in range(5)}
    assert [aid for aid, _ in d.outbox.next_batch()] == ["a0", "a1", "a2"]          # count cap
    d.opts.result_batch = 64
    assert [aid for aid, _ in d.outbox.next_batch()] == ["a0", "a1", "a2"]          # bytes cap (3 × 301)
    d.outbox.pending = {"big": out(5000, b"y"), "z": out(1)}
    assert [aid for aid, _ in d.outbox.next_batch()] == ["big"]                     # alone, even if over


def test_fresh_eval_sandbox_started_as_run_ends(controller, sandbox_dir):
    """A handler whose EVAL takes `sandbox_factory` (swe) gets a fresh sandbox, created when RUN
    ends; one EVAL did not use is closed by the daemon."""
    fake = controller(make_spec(workers=(2, 2, 2)))
    fake.add({"id": "uses"}, {"id": "skips", "skip_fresh": True})
    handler = FreshEvalTask()

    code = asyncio.run(asyncio.wait_for(daemon(fake, handler).run(), 60))
    assert code == 0 and len(fake.accepted) == 2
    uses = handler.fresh["uses"]
    assert uses["factory"] and uses["clean"] == "clean"              # not the RUN sandbox
    assert uses["id"] != handler.sandbox_ids["uses"]["run"]
    assert handler.fresh["skips"]["factory"]
    assert list(sandbox_dir.iterdir()) == []                          # both fresh ones closed too


def test_warm_pool_serves_init_and_no_sandbox_outlives_the_daemon(controller, sandbox_dir):
    """spec.sandbox.warm = 2: rollouts leased while the pool is full get its sandboxes (fresh ones,
    each to one rollout); when the daemon exits, the idle ones and any being started are closed."""
    from rolloutd.crds.kit.settings import SandboxSettings
    from rolloutd.sandbox import get_runtime

    class Recording:   # the real bwrap runtime; remembers every sandbox it made
        def __init__(self) -> None:
            self.inner, self.made = get_runtime("bwrap", SandboxSettings(sandbox_dir=sandbox_dir)), []

        async def create(self, spec):
            sb = await self.inner.create(spec)
            self.made.append(sb)
            return sb

    fake = controller(make_spec(workers=(1, 3, 1), sandbox={"warm": 2}))
    fake.add({"id": "first", "run_gate": "go"})
    handler, runtime = ScriptedTask(), Recording()

    async def scenario():
        d = NodeDaemon(options(fake), handler=handler, sandbox_runtime=runtime)
        run = asyncio.create_task(d.run())
        await until(lambda: "first" in handler.ran, 30, "the first rollout in RUN")
        await until(lambda: d.pipeline.pool.idle == 2, 30, "the pool full")
        warm = {sb.id for sb, _ in d.pipeline.pool._idle}
        fake.add({"id": "a"}, {"id": "b"})     # leased now: both INITs find a warm sandbox
        await until(lambda: {"a", "b"} <= set(handler.ran), 30, "a and b in RUN")
        handler.gate("go").set()
        return d, await asyncio.wait_for(run, 60), warm

    d, code, warm = asyncio.run(scenario())
    assert code == 0 and len(fake.accepted) == 3
    used = {tid: ids["init"] for tid, ids in handler.sandbox_ids.items()}
    assert {used["a"], used["b"]} == warm and len(set(used.values())) == 3
    assert d.pipeline.pool.stats["warm"] >= 2 and d.pipeline.pool.closed
    assert d.pipeline.pool.most == 1 + 3 + 1 + 2   # sized from the INIT rate within init + run + eval + warm
    for chain in handler.chains.values():   # each rollout kept its one sandbox through every stage
        assert chain["init"] == chain["run"] == chain["eval"]
    made = {sb.id: sb for sb in runtime.made}
    assert set(used.values()) <= set(made) and len(made) > len(used)   # the pool refilled after a and b
    assert all(not sb.root.exists() and not sandbox_pids(i) for i, sb in made.items())
    assert list(sandbox_dir.iterdir()) == []


def test_the_first_wave_finds_sandboxes_warmed_for_it_before_any_lease(controller, sandbox_dir):
    """The pool warms for a first wave as wide as the INIT pool (4 here; spec.sandbox.warm is 1) from the
    set-up on, while the tokenizer loads and before any lease: the first 4 INITs all get warm sandboxes."""
    fake = controller(make_spec(workers=(4, 4, 1), sandbox={"warm": 1}))
    fake.add(*({"id": f"t{i}"} for i in range(4)))
    fake.hold_next_lease = True   # the first lease call waits until the pool is warm
    handler = ScriptedTask()

    async def scenario():
        d = NodeDaemon(options(fake), handler=handler)
        run = asyncio.create_task(d.run())
        await until(lambda: d.pipeline is not None and d.pipeline.pool is not None and d.pipeline.pool.idle == 4,
                    60, "4 sandboxes warm before any lease")
        assert not handler.ran and sum(d.pipeline.pool.stats.values()) == 0   # nothing acquired yet
        fake.release_lease.set()
        return d, await asyncio.wait_for(run, 60)

    d, code = asyncio.run(scenario())
    assert code == 0 and len(fake.accepted) == 4
    assert (d.pipeline.pool.stats["warm"], d.pipeline.pool.stats["cold"]) == (4, 0)
    assert list(sandbox_dir.iterdir()) == []


def test_a_job_smaller_than_the_init_pool_warms_only_the_rollouts_that_can_land(controller, sandbox_dir):
    """2 prompts × 1 sample (tasks.limit) on an INIT pool of 6: the first wave warms 2 sandboxes, not 6 (the pool
    settles at 2 idle before any lease and never starts more), and both rollouts get warm ones."""
    fake = controller(make_spec(workers=(6, 6, 1), sandbox={"warm": 1},
                                tasks={"kind": "scripted", "source": "/dev/null", "limit": 2}))
    fake.add(*({"id": f"t{i}"} for i in range(2)))
    fake.hold_next_lease = True
    handler = ScriptedTask()

    async def scenario():
        d = NodeDaemon(options(fake), handler=handler)
        run = asyncio.create_task(d.run())
        await until(lambda: d.pipeline is not None and d.pipeline.pool is not None and d.pipeline.pool.idle >= 2
                    and not d.pipeline.pool._creating, 60, "the pool settled before any lease")
        pool = d.pipeline.pool
        settled = (pool.target, pool.idle, pool.held)
        fake.release_lease.set()
        return d, settled, await asyncio.wait_for(run, 60)

    d, settled, code = asyncio.run(scenario())
    assert code == 0 and len(fake.accepted) == 2
    assert settled == (2, 2, 2)
    assert (d.pipeline.pool.stats["warm"], d.pipeline.pool.stats["cold"]) == (2, 0)
    assert list(sandbox_dir.iterdir()) == []


# ------------------------------------------------------------------------------------- control
def test_repin_unknown_and_drain(controller, sandbox_dir):
    """repin before RUN moves the rollout to the new backend; `unknown` drops a rollout (sandbox
    closed, nothing reported); drain stops leasing and the daemon exits 0 once in-flight work is in (p3, leased
    and initialised ahead of the full RUN pool, included)."""
    fake = controller(make_spec(workers=(1, 1, 1)))
    fake.add({"id": "p0", "eval_gate": "g"}, {"id": "p1", "init_gate": "i"}, {"id": "p2", "run_gate": "r"},
             {"id": "p3"}, {"id": "p4"})
    handler, other = ScriptedTask(), "http://127.0.0.1:9/other"

    async def scenario():
        d = daemon(fake, handler)
        run = asyncio.create_task(d.run())
        await until(lambda: "p0" in handler.evals, 30, "p0 in EVAL")
        await until(lambda: "p1" in handler.sandboxes, 30, "p1 in INIT")
        p1 = fake.lease_of("p1").attempt_id
        fake.repins[p1] = other
        await until(lambda: d.rollouts.live[p1].backend == other, 10, "the repin applied")
        handler.gate("i").set()
        await until(lambda: "p2" in handler.ran, 30, "p2 in RUN")
        p2 = fake.lease_of("p2").attempt_id
        sandbox = handler.sandboxes["p2"]
        await until(lambda: "p3" in handler.sandboxes, 30, "p3 initialised ahead of the full RUN pool")
        fake.forget(p2)           # its lease expired on the controller: the next beat says unknown
        fake.drain = True         # ... and, in the same reply, drain
        await until(lambda: p2 not in d.rollouts.live, 10, "p2 dropped")
        await until(lambda: not sandbox.root.exists(), 10, "p2's sandbox closed")
        handler.gate("g").set()
        return d, await asyncio.wait_for(run, 30), p2

    d, code, p2 = asyncio.run(scenario())
    assert code == 0 and fake.deregistered == 1
    got = {t.task_id: t for t in (Trajectory.model_validate(w) for w in fake.accepted.values())}
    assert set(got) == {"p0", "p1", "p3"} and p2 not in fake.receipts
    assert got["p1"].backend == other and got["p0"].backend == fake.backend
    assert [item["task"]["id"] for item in fake.queue] == ["p4"]   # never leased: drained
    assert max_concurrent(intervals(d, "run", ("wait_eval",))) == 1
    assert list(sandbox_dir.iterdir()) == []


def test_a_job_that_takes_no_more_nodes_is_a_clean_exit_an_unknown_job_is_not(controller):
    """A daemon that starts after its job finished or began deletion (a late Slurm node) has
    nothing to do: exit 0, so the allocation ends COMPLETED. A job the controller never heard of
    is a misconfiguration: exit 2 (EXIT_REFUSED: a supervisor does not restart it)."""
    fake = controller(make_spec())
    fake.add({"id": "p0"})
    fake.register_conflict = 'rolloutjobs "demo" is Cancelling; it takes no more nodes'
    assert asyncio.run(daemon(fake, ScriptedTask()).run()) == 0
    assert len(fake.registers) == 1 and fake.lease_log == [] and fake.deregistered == 0

    fake.register_conflict = None
    assert asyncio.run(daemon(fake, ScriptedTask(), job="no-such-job").run()) == EXIT_REFUSED
    assert fake.lease_log == []


@pytest.mark.parametrize("name", ["no-tokenizer", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_a_tokenizer_that_does_not_load_is_reported_as_a_config_error_of_the_job(controller, tmp_path, name):
    """Nothing can run, and restarting the daemon cannot help: it reports the reason (naming the
    field) on one leased rollout, unscored, so the controller fails the job; then exits 2. Offline only: a model
    hub name is not tried at the hub (that took ~50 s, five attempts, and ended "couldn't connect")."""
    missing = str(tmp_path / name) if name == "no-tokenizer" else name
    fake = controller(make_spec(llm={"tokenizer": missing, "backends": [{"url": "http://127.0.0.1:9/llm"}]}))
    fake.add({"id": "p0"}, {"id": "p1"})
    assert asyncio.run(asyncio.wait_for(daemon(fake, ScriptedTask()).run(), 30)) == EXIT_REFUSED
    [t] = [Trajectory.model_validate(w) for w in fake.accepted.values()]
    assert t.failure.kind.value == "config" and t.reward is None
    assert t.failure.reason.startswith(f"spec.llm.tokenizer: cannot load {missing!r}")
    assert "offline only" in t.failure.reason
    assert fake.deregistered == 1


def test_the_same_sigterm_twice_is_one_stop_a_later_one_skips_the_grace(controller):
    """Under Slurm with a supervisor the daemon gets one SIGTERM twice within a moment (directly and
    forwarded): still a graceful drain. A second SIGTERM a second or more later means hurry."""
    d = daemon(controller(make_spec()), ScriptedTask())
    d.request_stop("SIGTERM")
    d.request_stop("SIGTERM")
    assert d.state is Shutdown.STOPPING
    d._stop_requested_at -= SAME_SIGNAL_SECONDS  # as if the second one came a second later
    d.request_stop("SIGTERM")
    assert d.state is Shutdown.HURRY



def test_the_shutdown_state_only_moves_up(controller):
    """One state instead of six flags: a weaker reason to leave never undoes a stronger one (a drain
    after "no more work", a lost controller after SIGTERM: the SIGTERM's graceful drain goes on)."""
    d = daemon(controller(make_spec()), ScriptedTask())
    assert d.state is Shutdown.RUNNING
    d._start_drain("the controller asked")
    assert d.state is Shutdown.DRAINING and d.reason == "drained"
    d._reach(Shutdown.DONE, "the job is done")
    d._start_drain("asked again")
    assert d.state is Shutdown.DONE and d.reason == "the job is done"
    d.request_stop("SIGTERM")
    d._lost("heartbeat: HTTP 404")
    assert d.state is Shutdown.STOPPING and d.reason == "SIGTERM"
