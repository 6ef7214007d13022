"""The job's spec read once for the node (agents/daemon/jobconfig.py): sampling, the handler's sandbox needs, and
the identity every reported trajectory carries."""
from __future__ import annotations

from typing import Any, ClassVar

from support.node_helpers import BASE_SPEC
from rolloutd.agents.daemon.jobconfig import JobConfig, load_spec, sampling_params
from rolloutd.crds.node import Lease
from rolloutd.crds.rolloutjob import SamplingSpec
from support.scripted_tasks import FreshEvalTask, ScriptedTask

LIMITS = {"max_tokens_per_turn", "max_total_tokens"}   # the loop's limits, not sampling fields


def test_every_sampling_field_of_the_spec_reaches_the_llm_client():
    s = SamplingSpec(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_tokens_per_turn=33, max_total_tokens=999,
                     seed=5, stop=["END"], repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3)
    p = sampling_params(s)
    assert p.max_tokens == 33
    for name in set(SamplingSpec.model_fields) - LIMITS:
        assert getattr(p, name) == getattr(s, name), name


def test_the_handler_says_whether_eval_gets_a_fresh_sandbox_and_whether_warm_sandboxes_help():
    spec = load_spec({**BASE_SPEC, "sandbox": {**BASE_SPEC["sandbox"], "warm": 3}})

    class OwnImage(ScriptedTask):
        async def sandbox_spec(self, task: dict, base: Any) -> Any:
            return base

    class NoSandbox(ScriptedTask):
        needs_sandbox: ClassVar[bool] = False
        eval_sandbox: ClassVar[bool] = True   # moot: it has no sandbox at all

    plain = JobConfig.build(spec, job="j", node="n", handler=ScriptedTask())
    assert plain.needs_sandbox and not plain.eval_sandbox and plain.warm == 3
    assert JobConfig.build(spec, job="j", node="n", handler=FreshEvalTask()).eval_sandbox
    assert JobConfig.build(spec, job="j", node="n", handler=OwnImage()).warm == 0
    no_tools = load_spec({**BASE_SPEC, "agent": {**BASE_SPEC["agent"], "tools": ["submit"]}})
    bare = JobConfig.build(no_tools, job="j", node="n", handler=NoSandbox())
    assert not bare.needs_sandbox and not bare.eval_sandbox
    # a bash tool needs a sandbox even when the handler does not
    assert JobConfig.build(spec, job="j", node="n", handler=NoSandbox()).needs_sandbox


def test_a_stand_in_carries_the_attempts_identity_and_an_infra_failure():
    config = JobConfig.build(load_spec(BASE_SPEC), job="demo", node="gpu-1", handler=ScriptedTask())
    lease = Lease(attempt_id="a-1", item=4, prompt=2, sample=1, attempt=3, task={"id": "t2"},
                  backend="http://b:1", policy_version=7)
    t = config.stand_in(lease, "refused " + "x" * 3000)
    assert (t.job, t.prompt, t.sample, t.attempt, t.task_id) == ("demo", 2, 1, 3, "t2")
    assert (t.node, t.backend, t.policy_version) == ("gpu-1", "http://b:1", 7)
    assert t.failure.kind.value == "infra" and t.reward is None and t.finish_reason == "error"
    assert len(t.failure.reason) == 2000
    ctx = config.context(lease, "http://other:2")   # what the agent loop copies into its trajectory
    assert (ctx.job, ctx.prompt, ctx.sample, ctx.attempt, ctx.task_id, ctx.node, ctx.backend, ctx.policy_version) \
        == ("demo", 2, 1, 3, "t2", "gpu-1", "http://other:2", 7)


def test_the_first_wave_is_the_init_pool_or_the_rollouts_that_can_land_whichever_is_fewer():
    def config(**sections: Any) -> JobConfig:
        return JobConfig.build(load_spec({**BASE_SPEC, **sections}), job="j", node="n", handler=ScriptedTask())

    tasks = BASE_SPEC["tasks"]
    assert config().landable() is None and config().first_wave(8) == 8              # no bound known
    assert config(tasks={**tasks, "limit": 2}, samplesPerPrompt=3).first_wave(8) == 6
    assert config(tasks={**tasks, "limit": 20}, samplesPerPrompt=3).first_wave(8) == 8
    assert config(dapo={"enabled": True, "targetGroups": 1}, samplesPerPrompt=2).landable() == 4
    assert config(batches={"groups": 1, "maxInFlightGroups": 3}, samplesPerPrompt=2).landable() == 6


def test_the_jobs_handler_options_reach_the_handler():
    spec = load_spec({**BASE_SPEC, "tasks": {"kind": "math", "source": "/dev/null", "options": {"requireBoxed": True}}})
    assert JobConfig.build(spec, job="j", node="n").handler.require_boxed is True
    plain = load_spec({**BASE_SPEC, "tasks": {"kind": "math", "source": "/dev/null"}})
    assert JobConfig.build(plain, job="j", node="n").handler.require_boxed is False
