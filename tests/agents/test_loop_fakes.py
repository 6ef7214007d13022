"""The agent loop's token bookkeeping and failure classes, with a scripted LLM and a fake sandbox.

The tokenizer is the tiny model's real one (built here in the main venv: no torch needed)."""
import asyncio
import json

import pytest

from rolloutd.agents.llm import BackendError, Generation, RequestRejected, SamplingParams, derive_seed
from rolloutd.agents.loop.run import run_agent_loop
from rolloutd.agents.engine.model_build import build_tiny_tokenizer
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext
from rolloutd.crds.trajectory import FailureKind

from support.agent_fakes import FakeSandbox, ScriptedLLM


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny_tokenizer(out)
    return ChatTokenizer(out)


MESSAGES = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "What is 2 + 3?"}]
CTX = RolloutContext(job="j", prompt=3, sample=1, task_id="t3", node="n1", policy_version=7, backend="b0")


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def run(tok, replies, *, sandbox=None, **cfg):
    llm = ScriptedLLM(tok, replies)
    config = AgentConfig(**{"sampling": SamplingParams(seed=11), **cfg})
    result = asyncio.run(run_agent_loop(MESSAGES, sandbox=sandbox if sandbox is not None else FakeSandbox(),
                                        llm=llm, tokenizer=tok, config=config, ctx=CTX))
    return result, llm


def check_bookkeeping(traj, llm, tok):
    """Every prompt is the previous prompt + generated ids + observation ids; mask and logprobs
    align with the generated ids exactly."""
    n = len(traj.token_ids)
    assert len(traj.loss_mask) == len(traj.logprobs) == n
    assert llm.prompts[0] == traj.token_ids[: traj.prompt_length]
    generated = set()
    for i, turn in enumerate(traj.turns):
        assert llm.prompts[i] == traj.token_ids[: turn.generated_start]
        generated.update(range(turn.generated_start, turn.generated_end))
        if turn.observation_start is not None:
            assert turn.observation_start == turn.generated_end
            if i + 1 < len(traj.turns):
                assert traj.turns[i + 1].generated_start == turn.observation_end
    for pos in range(n):
        assert traj.loss_mask[pos] == (1 if pos in generated else 0)
        assert (traj.logprobs[pos] is not None) == (pos in generated)


def test_multi_turn_bookkeeping_and_submit(tok):
    sandbox = FakeSandbox()
    result, llm = run(tok, [call("bash", command="echo five"), "Thinking.\n" + call("submit", answer="5")],
                      sandbox=sandbox)
    traj = result.trajectory
    check_bookkeeping(traj, llm, tok)
    assert result.submitted == "5" and traj.finish_reason == "submit"
    assert traj.failure.kind == FailureKind.none and traj.reward is None
    assert sandbox.commands == ["echo five"]
    # the observation the model saw is the templated tool message + next generation prompt
    first = traj.turns[0]
    obs = tok.decode(traj.token_ids[first.observation_start:first.observation_end])
    assert "five" in obs and obs.endswith("<|im_start|>assistant\n")
    decoded = tok.decode(traj.token_ids)
    assert traj.metrics["tool_calls"] == 2 and traj.metrics["turns"] == 2
    assert [c["name"] for c in traj.turns[0].tool_calls] == ["bash"]
    assert (traj.job, traj.prompt, traj.sample, traj.task_id, traj.node, traj.policy_version, traj.backend) == (
        "j", 3, 1, "t3", "n1", 7, "b0")
    assert decoded.count("<|im_start|>assistant\n") == 2
    wire = traj.wire()
    assert wire["lossMask"] == traj.loss_mask and wire["prompt"] == 3


def test_observation_ids_match_the_template(tok):
    """Prompt + generated + observation == the template rendering of the same conversation."""
    result, llm = run(tok, [call("bash", command="echo hello"), "The answer is 5."], tools=["bash"])
    traj = result.trajectory
    specs_text = tok.decode(traj.token_ids[: traj.prompt_length])
    conversation = traj.messages
    from rolloutd.agents.loop.tools import tool_specs

    rendered = tok.render(conversation, tools=tool_specs(["bash"]))
    # the template closes the last turn with "<|im_end|>\n"; the model generated up to <|im_end|>
    assert tok.decode(traj.token_ids) + "\n" == rendered
    assert specs_text == tok.render(conversation[:2], tools=tool_specs(["bash"]), add_generation_prompt=True)
    assert result.final_text == "The answer is 5." and result.submitted is None
    assert traj.finish_reason == "stop" and traj.failure.kind == FailureKind.none


def test_seeds_are_derived_per_prompt_sample_turn(tok):
    result, llm = run(tok, [call("bash", command="echo a"), "done"])
    seeds = [s.seed for s in llm.samplings]
    assert seeds == [derive_seed(11, 3, 1, 0), derive_seed(11, 3, 1, 1)]
    assert seeds[0] != seeds[1] and derive_seed(11, 3, 2, 0) != seeds[0]
    assert derive_seed(None, 1, 2, 3) is None
    assert len(set(llm.request_ids)) == 2


def test_malformed_call_is_an_observation_the_model_recovers_from(tok):
    result, llm = run(tok, ['<tool_call>{"name": "bash", "arguments": {"command": }</tool_call>',
                            call("submit", answer="5")])
    traj = result.trajectory
    check_bookkeeping(traj, llm, tok)
    assert traj.metrics["malformed_tool_calls"] == 1 and traj.metrics["tool_errors"] == 1
    first = traj.turns[0]
    assert "not valid JSON" in tok.decode(traj.token_ids[first.observation_start:first.observation_end])
    assert result.submitted == "5" and traj.failure.kind == FailureKind.none


def test_turn_limit_is_an_agent_failure(tok):
    result, llm = run(tok, [call("bash", command="echo x")] * 3, max_turns=3)
    traj = result.trajectory
    check_bookkeeping(traj, llm, tok)
    assert traj.failure.kind == FailureKind.agent and "turn limit" in traj.failure.reason
    assert len(traj.turns) == 3 and traj.turns[-1].observation_start is None
    assert traj.token_ids[-1] == min(tok.eos_token_ids)  # ends on the generated EOS, no dangling observation


def test_token_limits(tok):
    long_reply = " ".join(["word"] * 100)
    result, llm = run(tok, [long_reply], max_tokens_per_turn=16)
    traj = result.trajectory
    assert llm.samplings[0].max_tokens == 16
    assert traj.failure.kind == FailureKind.agent and traj.finish_reason == "length"
    assert sum(traj.loss_mask) == 16

    prompt_len = len(tok.encode_chat(MESSAGES, tools=None))
    result, llm = run(tok, [call("bash", command="echo x"), long_reply], tools=["bash"],
                      max_total_tokens=prompt_len + 200, max_tokens_per_turn=256)
    traj = result.trajectory
    assert llm.samplings[0].max_tokens <= 200
    assert len(traj.token_ids) <= prompt_len + 200 + 40  # tool description is part of the prompt
    assert traj.failure.kind == FailureKind.agent


def test_backend_failure_is_infra_never_a_reward(tok):
    result, _ = run(tok, [call("bash", command="echo x"), BackendError("connection reset")])
    traj = result.trajectory
    assert traj.failure.kind == FailureKind.infra and "connection reset" in traj.failure.reason
    assert traj.reward is None and len(traj.turns) == 1


def test_a_prompt_longer_than_the_token_budget_is_a_config_error_not_a_reward(tok):
    prompt_len = len(tok.encode_chat(MESSAGES, tools=None))
    result, llm = run(tok, ["never sent"], tools=[], max_total_tokens=prompt_len - 1, max_tokens_per_turn=1)
    traj = result.trajectory
    assert traj.failure.kind == FailureKind.config and traj.reward is None and llm.prompts == []
    assert traj.failure.reason == (f"spec.agent.sampling.maxTotalTokens: the prompt of task t3 has {prompt_len} "
                                   f"tokens, more than {prompt_len - 1}")


class ContextTooSmall(ScriptedLLM):
    """A backend whose model context cannot hold the prompt (VLLMBackend answers so: no tokens, length)."""
    max_model_len = 8

    async def generate(self, prompt_ids, sampling, request_id):
        self.prompts.append(list(prompt_ids))
        return Generation([], [], "length", list(prompt_ids), None)


def test_a_prompt_longer_than_the_model_context_or_a_refused_request_is_a_config_error(tok):
    config = AgentConfig(tools=[], sampling=SamplingParams(seed=11))
    result = asyncio.run(run_agent_loop(MESSAGES, sandbox=FakeSandbox(), llm=ContextTooSmall(tok, []),
                                        tokenizer=tok, config=config, ctx=CTX))
    failure = result.trajectory.failure
    assert failure.kind == FailureKind.config and failure.reason.startswith("spec.llm.backends: the prompt of task t3")
    assert "more than 8 (the context of the model at b0)" in failure.reason
    result, _ = run(tok, [RequestRejected("HTTP 400: top_k must be -1 or at least 1")], tools=[])
    failure = result.trajectory.failure
    assert failure.kind == FailureKind.config and "top_k must be" in failure.reason and result.trajectory.reward is None


class RestartingLLM(ScriptedLLM):
    """Unreachable for its first `down` calls (killed, restarting); `wait_healthy` counts the waits."""

    def __init__(self, tok, replies, down):
        super().__init__(tok, replies)
        self.down, self.waits = down, 0

    async def generate(self, prompt_ids, sampling, request_id):
        if self.down:
            self.down -= 1
            self.request_ids.append(request_id)
            raise BackendError("connection refused", unreachable=True)
        return await super().generate(prompt_ids, sampling, request_id)

    async def wait_healthy(self, timeout):
        self.waits += 1
        return True


def test_an_unreachable_backend_is_waited_for_and_the_turn_sent_again(tok):
    llm = RestartingLLM(tok, ["5"], down=3)
    config = AgentConfig(tools=[], sampling=SamplingParams(seed=11), run_timeout=60)
    result = asyncio.run(run_agent_loop(MESSAGES, sandbox=FakeSandbox(), llm=llm, tokenizer=tok, config=config, ctx=CTX))
    traj = result.trajectory
    assert traj.failure.kind == FailureKind.none and result.final_text == "5" and llm.waits == 3
    assert len(set(llm.request_ids)) == 4 and traj.metrics["backend_waits"] == 3
    # an answer that is not "unreachable" (a 5xx) is not waited for
    llm = RestartingLLM(tok, [BackendError("HTTP 500")], down=0)
    result = asyncio.run(run_agent_loop(MESSAGES, sandbox=FakeSandbox(), llm=llm, tokenizer=tok, config=config, ctx=CTX))
    assert result.trajectory.failure.kind == FailureKind.infra and llm.waits == 0


def test_sandbox_death_is_infra(tok):
    result, _ = run(tok, [call("bash", command="crash now")], sandbox=FakeSandbox(die_on="crash"))
    assert result.trajectory.failure.kind == FailureKind.infra
    assert "SandboxDied" in result.trajectory.failure.reason


def test_request_errors_are_observations(tok):
    sandbox = FakeSandbox(files={"a.py": "x = 1\n"})
    replies = [
        call("editor", command="view", path="missing.py"),
        call("editor", command="str_replace", path="a.py", old_str="x = 1", new_str="x = 2"),
        call("editor", command="create", path="b.py", file_text="print(2)\n"),
        call("ipython", code="1/0"),
        call("bash", command="sleep 100"),
        call("submit", answer="ok"),
    ]
    result, llm = run(sandbox=sandbox, tok=tok, replies=replies, max_turns=6)
    traj = result.trajectory
    check_bookkeeping(traj, llm, tok)
    assert traj.failure.kind == FailureKind.none and result.submitted == "ok"
    assert sandbox.files == {"a.py": "x = 2\n", "b.py": "print(2)\n"}
    observations = [m["content"] for m in traj.messages if m["role"] == tok.observation_role]
    assert "no such file" in observations[0]
    assert "ZeroDivisionError" in observations[3]
    assert "timed out" in observations[4]
    assert traj.metrics["tool_errors"] == 3


def test_run_timeout_is_infra(tok):
    result, _ = run(tok, [call("bash", command="hang")], sandbox=FakeSandbox(hang_on="hang"),
                    run_timeout=0.5)
    assert result.trajectory.failure.kind == FailureKind.infra and "RUN stage" in result.trajectory.failure.reason


def test_no_tools_template_gets_instructions_in_the_system_message(tok, monkeypatch):
    monkeypatch.setattr(type(tok), "supports_tools", property(lambda self: False))
    result, llm = run(tok, ["5"])
    system = result.trajectory.messages[0]
    assert system["role"] == "system" and system["content"].startswith("Solve it.") and "<tool_call>" in system["content"]


def test_turn_without_eos_gets_the_closing_ids_in_the_observation(tok):
    llm = ScriptedLLM(tok, [call("bash", command="echo x"), "5"], close_with_eos=False)
    result = asyncio.run(run_agent_loop(MESSAGES, sandbox=FakeSandbox(), llm=llm, tokenizer=tok,
                                        config=AgentConfig(tools=["bash"]), ctx=CTX))
    traj = result.trajectory
    first = traj.turns[0]
    assert traj.token_ids[first.generated_end - 1] not in tok.eos_token_ids
    assert traj.token_ids[first.observation_start] in tok.eos_token_ids  # closing ids, mask 0
    assert traj.loss_mask[first.observation_start] == 0


def test_drift_check_reports_non_canonical_tokenizations(tok):
    # spell "hello" one character at a time: valid ids, but not what the tokenizer would produce
    class Spelled(ScriptedLLM):
        async def generate(self, prompt_ids, sampling, request_id):
            gen = await super().generate(prompt_ids, sampling, request_id)
            spelled = [i for ch in "hello" for i in self.tok.encode_text(ch)] + [min(self.tok.eos_token_ids)]
            gen.token_ids, gen.logprobs = spelled, [-1.0] * len(spelled)
            return gen

    llm = Spelled(tok, ["x"])
    result = asyncio.run(run_agent_loop(MESSAGES, sandbox=None, llm=llm, tokenizer=tok,
                                        config=AgentConfig(tools=[], drift_check=True), ctx=CTX))
    m = result.trajectory.metrics
    assert m["drift_mismatches"] > 0 and m["drift_first_position"] >= result.trajectory.prompt_length
    ok = asyncio.run(run_agent_loop(MESSAGES, sandbox=None, llm=ScriptedLLM(tok, ["hello"]), tokenizer=tok,
                                    config=AgentConfig(tools=[], drift_check=True), ctx=CTX))
    assert ok.trajectory.metrics["drift_mismatches"] == 0


def test_unexpected_sandbox_exception_is_infra_not_an_observation(tok):
    class Broken(FakeSandbox):
        async def bash(self, command, timeout=None):
            raise RuntimeError("future belongs to a different loop")

    result, _ = run(tok, [call("bash", command="ls")], sandbox=Broken())
    traj = result.trajectory
    assert traj.failure.kind == FailureKind.infra and "different loop" in traj.failure.reason
    assert traj.turns[0].observation_start is None  # the model never saw our bug


def test_the_jobs_system_prompt_replaces_the_task_kinds_own(tok):
    """`spec.agent.systemPrompt` reaches the model: the math handler's conversation, through the job's config."""
    from rolloutd.agents.daemon.jobconfig import load_spec, JobConfig
    from rolloutd.agents.tasks import get_handler
    from support.node_helpers import BASE_SPEC

    spec = load_spec({**BASE_SPEC, "tasks": {"kind": "math", "source": "/dev/null"},
                      "agent": {**BASE_SPEC["agent"], "tools": ["submit"], "systemPrompt": "Answer like a pirate."}})
    handler = get_handler("math")
    config = JobConfig.build(spec, job="j", node="n", handler=handler).agent
    llm = ScriptedLLM(tok, ["\\boxed{4}"])
    task = {"id": "t", "question": "What is 2 + 2?", "answer": "4"}
    asyncio.run(handler.run(task, FakeSandbox(), llm, tokenizer=tok, config=config, ctx=CTX))
    sent = tok.decode(llm.prompts[0])
    assert "Answer like a pirate." in sent and handler.system_prompt.split(".")[0] not in sent
