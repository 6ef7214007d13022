"""The harness gateway (agents/gateway/server.py, agents/tasks/harness.py): stitching rules, and a black-box
harness — a stdlib script that only knows OPENAI_BASE_URL — run in a Harbor task's sandbox against the
real tiny vLLM engine: every call is recorded token-exactly (the engine re-scores the stitched ids to
the recorded logprobs), a rewritten history starts a new segment, the sandbox keeps no network."""
import asyncio
import shutil
from pathlib import Path

import httpx
import pytest

from rolloutd.agents.gateway.server import Call, stitch
from rolloutd.agents.wire.openai import parse_tool_calls
from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.tasks import get_handler
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext
from rolloutd.client import sequences

from support.harbor_rollouts import task_sandbox

TASKS = Path(__file__).resolve().parents[2] / "examples" / "harbor" / "tasks"

HARNESS = r'''
import json, os, sys, urllib.request
base = os.environ["OPENAI_BASE_URL"]
def post(path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=120).read().decode()
task = sys.stdin.read()
msgs = [{"role": "user", "content": task}]
first = json.loads(post("/chat/completions", {"model": "any", "messages": msgs, "max_tokens": 8}))
msgs += [first["choices"][0]["message"], {"role": "user", "content": "Go on."}]
second = json.loads(post("/chat/completions", {"model": "any", "messages": msgs, "max_tokens": 8}))
# the harness summarises: a rewritten history, streamed
stream = post("/chat/completions", {"messages": [{"role": "user", "content": "Summary: count words."}], "stream": True})
chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
models = json.loads(urllib.request.urlopen(base + "/models").read())
try:
    urllib.request.urlopen("http://example.org", timeout=5)
    net = "reachable"
except Exception:
    net = "unreachable"
print(json.dumps({"finish": [first["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["finish_reason"]],
                  "model": models["data"][0]["id"], "net": net}))
'''


def test_stitch_continues_extensions_and_splits_rewrites():
    calls = [Call([1, 2], [3, 4], [-0.1, -0.2], "stop"),
             Call([1, 2, 3, 4, 5], [6], [-0.3], "stop"),       # extends: +5 as context, 6 generated
             Call([9, 1], [7], [-0.4], "length")]              # rewritten: a new segment
    one, two = stitch(calls)
    assert (one.token_ids, one.loss_mask, one.logprobs) == (
        [1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1], [None, None, -0.1, -0.2, None, -0.3])
    assert (one.prompt_length, one.calls, one.drift) == (2, 2, False)
    assert (two.token_ids, two.loss_mask, two.calls, two.drift) == ([9, 1, 7], [0, 0, 1], 1, False)
    # same text, other ids (a re-tokenized history): marked as drift, still a new segment
    text = {(1, 2, 3, 4): "ab", (1, 2, 34): "ab!"}
    _, drifted = stitch([calls[0], Call([1, 2, 34], [8], [-0.5], "stop")], decode=lambda ids: text[tuple(ids)])
    assert drifted.drift


def test_piecewise_prompt_ids_equal_one_encoding_of_the_whole_text():
    """The gateway encodes each stretch between added tokens once per rollout: the ids must be exactly those
    of encoding the whole rendered text, whatever the conversation (spaces, newlines, unicode, tools)."""
    from rolloutd.agents.gateway.server import PieceEncoder

    tok = ChatTokenizer(model_dir("tiny"))
    pieces = PieceEncoder(tok)
    assert pieces._split is not None  # the fast path is the one under test
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    history = [{"role": "system", "content": "You are  a terminal agent.\n"}]
    for i, text in enumerate(["Count words in  words.txt ", "  état: ok\n\n", "<tool_call>{\"name\": \"bash\"}</tool_call>",
                              "日本語 and emoji 🚀", "trailing space ", "\tTabbed\r\nCRLF", ""]):
        history.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        for tool_list in (None, tools):
            rendered = tok.render(history, tools=tool_list, add_generation_prompt=True)
            assert pieces.encode(rendered) == tok.encode_text(rendered)
            assert pieces.encode(rendered) == tok.encode_text(rendered)  # again, from the cache
    assert len(pieces._cache) > 3


def test_tool_call_blocks_become_openai_tool_calls():
    content, calls = parse_tool_calls('Let me look.<tool_call>{"name": "bash", "arguments": {"cmd": "ls"}}</tool_call>')
    assert content == "Let me look." and calls[0]["function"] == {"name": "bash", "arguments": '{"cmd": "ls"}'}
    assert parse_tool_calls("no call here") == ("no call here", [])


def test_black_box_harness_through_the_gateway_is_token_exact(tiny_engine):
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")
    tok = ChatTokenizer(model_dir("tiny"))
    handler = get_handler("harbor")
    task = {t["id"]: t for t in handler.load(TASKS)}["word-count"]

    async def go():
        async with task_sandbox(handler, task) as sandbox:
            await sandbox.write_file("/tmp/harness.py", HARNESS)
            async with VLLMBackend(tiny_engine.url) as llm:
                config = AgentConfig(agent_kind="harness", agent_command="python3 /tmp/harness.py",
                                     sampling=SamplingParams(seed=7, max_tokens=16, stop_token_ids=list(range(100, 500))))
                trajectory = await handler.run(task, sandbox, llm, tokenizer=tok, config=config,
                                               ctx=RolloutContext(job="gw", prompt=0, sample=0, task_id=task["id"]))
            output = await sandbox.read_file("/logs/agent/harness.txt")
            reward = await handler.eval(task, sandbox, trajectory)
            return trajectory, output, reward

    trajectory, output, reward = asyncio.run(go())
    assert trajectory.failure.kind.value == "none", (trajectory.failure, output)
    report = __import__("json").loads(output.strip().splitlines()[-1])
    assert report["model"] == "policy" and report["net"] == "unreachable" and report["finish"][1] in ("stop", "length")
    segments = [seg.model_dump() for seg in trajectory.segments]  # the history was rewritten: several sequences
    assert trajectory.token_ids == [] and trajectory.wire()["segments"][0]["tokenIds"] == segments[0]["token_ids"]
    assert trajectory.metrics["gateway_calls"] == 3 and sum(s["calls"] for s in segments) == 3
    assert len(segments) >= 2 and segments[-1]["calls"] == 1  # the summary rewrote the history
    assert sum(len(s["turns"]) for s in segments) == 3  # one generated run per call, in its own sequence
    first = segments[0]
    assert first["token_ids"][: first["prompt_length"]] == tok.encode_chat([{"role": "user", "content": task["instruction"]}])
    assert segments[-1]["token_ids"][: segments[-1]["prompt_length"]] == tok.encode_chat(
        [{"role": "user", "content": "Summary: count words."}])
    for seg in segments:  # token-exact: the engine re-scores the stitched ids to the recorded logprobs
        r = httpx.post(f"{tiny_engine.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": seg["token_ids"], "max_tokens": 1, "prompt_logprobs": 0,
            "return_token_ids": True}).json()["choices"][0]
        generated = [i for i, m in enumerate(seg["loss_mask"]) if m]
        assert generated and r["prompt_token_ids"] == seg["token_ids"]
        rescored = [r["prompt_logprobs"][i][str(seg["token_ids"][i])]["logprob"] for i in generated]
        assert rescored == pytest.approx([seg["logprobs"][i] for i in generated], abs=1e-3)
    assert reward.value == 0.0  # the harness never solved the task: EVAL scores it like any agent


def test_a_backend_failure_behind_a_call_is_infra():
    """The backend fails (a real sandbox and gateway; an LLM double that raises): the harness sees a
    502 and the rollout is infra, never an agent failure or a reward."""
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")
    from rolloutd.agents.llm import BackendError

    class DownLLM:
        async def generate(self, prompt_ids, sampling, request_id):
            raise BackendError("connection refused")

    handler = get_handler("harbor")
    task = {t["id"]: t for t in handler.load(TASKS)}["word-count"]

    async def go():
        async with task_sandbox(handler, task) as sandbox:
            await sandbox.write_file("/tmp/harness.py", HARNESS)
            config = AgentConfig(agent_kind="harness", agent_command="python3 /tmp/harness.py",
                                 sampling=SamplingParams(max_tokens=8))
            return await handler.run(task, sandbox, DownLLM(), tokenizer=ChatTokenizer(model_dir("tiny")),
                                     config=config, ctx=RolloutContext(job="gw", prompt=0, sample=0))

    trajectory = asyncio.run(go())
    assert trajectory.failure.kind.value == "infra" and "connection refused" in trajectory.failure.reason
    assert trajectory.metrics["gateway_calls"] == 0 and trajectory.token_ids == []


MINI = ("MSWEA_CONFIGURED=true MSWEA_SILENT_STARTUP=1 MSWEA_COST_TRACKING=ignore_errors "
        "LITELLM_LOCAL_MODEL_COST_MAP=True HOME=/tmp/home "
        "mini --agent-class default --model-class litellm_textbased -m openai/policy -c mini_textbased.yaml "
        "-c agent.step_limit=3 -c agent.cost_limit=0 -c model.model_kwargs.api_base=$OPENAI_BASE_URL "
        "-c model.model_kwargs.api_key=$OPENAI_API_KEY -o /logs/agent/mini.traj.json "
        "-t \"$(cat $ROLLOUTD_INSTRUCTION_FILE)\"")


def test_mini_swe_agent_from_pypi_drives_smollm2_through_the_gateway(smollm2_engine):
    """mini-swe-agent 2.4.6 (PyPI, through litellm), installed by the task's Dockerfile, run unchanged
    as `agent.command` in the task's sandbox: each of its LLM calls is recorded exactly once and token-exactly
    (the fp32 engine re-scores the stitched ids to the recorded logprobs within fp32 noise)."""
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")
    tok = ChatTokenizer(model_dir("smollm2"))
    handler = get_handler("harbor")
    [task] = handler.load(Path(__file__).parent / "harness_tasks")

    async def go():
        async with task_sandbox(handler, task) as sandbox:
            async with VLLMBackend(smollm2_engine.url) as llm:
                # the job's token budget, declared as a harness job must: the engine's whole context
                config = AgentConfig(agent_kind="harness", agent_command=MINI, max_total_tokens=4096,
                                     sampling=SamplingParams(seed=3, max_tokens=64))
                trajectory = await handler.run(task, sandbox, llm, tokenizer=tok, config=config,
                                               ctx=RolloutContext(job="mini", prompt=0, sample=0, task_id=task["id"]))
            mini_traj = await sandbox.read_file("/logs/agent/mini.traj.json")
            return trajectory, mini_traj, await handler.eval(task, sandbox, trajectory)

    trajectory, mini_traj, reward = asyncio.run(go())
    assert trajectory.failure.kind.value != "infra", (trajectory.failure, trajectory.metrics["harness_output"])
    calls = trajectory.metrics["gateway_calls"]
    counted = __import__("json").loads(mini_traj)["info"]["model_stats"]["api_calls"]  # mini's own count
    assert calls >= 1 and counted == calls  # every call the harness made, recorded exactly once
    segments = sequences(trajectory.wire())  # as a trainer reads it: the segments, or the one flat sequence
    assert sum(len(s["turns"]) for s in segments) == calls  # one generated run per call
    worst = 0.0
    for seg in segments:
        r = httpx.post(f"{smollm2_engine.url}/v1/completions", timeout=300, json={
            "model": smollm2_engine.served_name, "prompt": seg["tokenIds"], "max_tokens": 1, "prompt_logprobs": 0,
            "return_token_ids": True}).json()["choices"][0]
        assert r["prompt_token_ids"] == seg["tokenIds"]
        generated = [i for i, m in enumerate(seg["lossMask"]) if m]
        rescored = [r["prompt_logprobs"][i][str(seg["tokenIds"][i])]["logprob"] for i in generated]
        worst = max([worst, *(abs(a - seg["logprobs"][i]) for a, i in zip(rescored, generated))])
    assert worst < 1e-3, worst
    assert reward.value in (0.0, 1.0)


def test_cancelling_the_rollout_cancels_the_harness_calls():
    """DAPO or a delete cancels RUN: the gateway's in-flight backend call is cancelled (VLLMBackend then
    aborts it server-side) and the sandbox close ends the harness."""
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")
    handler = get_handler("harbor")
    task = {t["id"]: t for t in handler.load(TASKS)}["word-count"]

    class HangingLLM:
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def generate(self, prompt_ids, sampling, request_id):
            self.started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise

    async def go():
        llm = HangingLLM()
        async with task_sandbox(handler, task) as sandbox:
            await sandbox.write_file("/tmp/harness.py", HARNESS)
            config = AgentConfig(agent_kind="harness", agent_command="python3 /tmp/harness.py",
                                 sampling=SamplingParams(max_tokens=8))
            run = asyncio.ensure_future(handler.run(task, sandbox, llm, tokenizer=ChatTokenizer(model_dir("tiny")),
                                                    config=config, ctx=RolloutContext(job="gw", prompt=0, sample=0)))
            await asyncio.wait_for(llm.started.wait(), 120)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            await asyncio.wait_for(llm.cancelled.wait(), 10)
        return llm.cancelled.is_set()

    assert asyncio.run(go())


def test_a_harness_that_never_calls_the_model_is_still_scored_by_eval():
    """A harness may solve a task without one model call (or fail before its first): the rollout is not an infra
    failure and EVAL scores the sandbox as for any agent. The backend here answers nothing: no call may reach it."""
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")
    handler = get_handler("harbor")
    task = {t["id"]: t for t in handler.load(TASKS)}["word-count"]
    solve = ("cd /srv/corpus && grep -oE '[A-Za-z]+' words.txt | tr 'A-Z' 'a-z' | sort -u | wc -l | tr -d ' ' "
             "> distinct.txt")

    async def go():
        async with task_sandbox(handler, task) as sandbox:
            async with VLLMBackend("http://127.0.0.1:9") as llm:  # discard port: nothing listens
                config = AgentConfig(agent_kind="harness", agent_command=solve, sampling=SamplingParams(seed=7))
                trajectory = await handler.run(task, sandbox, llm, tokenizer=None, config=config,
                                               ctx=RolloutContext(job="gw", prompt=0, sample=0, task_id=task["id"]))
            return trajectory, await handler.eval(task, sandbox, trajectory)

    trajectory, reward = asyncio.run(go())
    assert trajectory.failure.kind.value == "none", trajectory.failure
    assert trajectory.metrics["gateway_calls"] == 0 and trajectory.token_ids == [] and trajectory.segments == []
    assert reward.value == 1.0


def test_a_harness_with_a_model_that_never_calls_it_fails_as_configuration_naming_what_it_printed():
    """A job with a model whose harness made no call (Claude Code without its offline variables, say) has no
    sample to train on: a configuration failure quoting the harness's output, never a reward of the policy's."""
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")

    class UnusedLLM:
        async def generate(self, prompt_ids, sampling, request_id):
            raise AssertionError("no call was made")

    handler = get_handler("harbor")
    task = {t["id"]: t for t in handler.load(TASKS)}["word-count"]

    async def go():
        async with task_sandbox(handler, task) as sandbox:
            config = AgentConfig(agent_kind="harness", agent_command="echo 'Invalid API key · Please run /login'",
                                 sampling=SamplingParams(max_tokens=8))
            return await handler.run(task, sandbox, UnusedLLM(), tokenizer=ChatTokenizer(model_dir("tiny")),
                                     config=config, ctx=RolloutContext(job="gw", prompt=0, sample=0))

    trajectory = asyncio.run(go())
    assert trajectory.failure.kind.value == "config", trajectory.failure
    assert trajectory.failure.reason.startswith("spec.agent.command: the harness made no model call")
    assert "Invalid API key" in trajectory.failure.reason


def test_each_known_harness_gets_its_offline_defaults_and_the_sandbox_env_overrides_them():
    """The defaults of agents/tasks/harness.py HARNESS_DEFAULTS reach the harness's shell (Claude Code's, mini-swe-
    agent's, a Codex config naming the gateway); a variable of `spec.sandbox.env` wins, even set empty."""
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")
    handler = get_handler("harbor")
    task = {t["id"]: t for t in handler.load(TASKS)}["word-count"]
    show = ('echo "T=$DISABLE_TELEMETRY/A=$DISABLE_AUTOUPDATER/M=$ANTHROPIC_MODEL/W=$MSWEA_MODEL_NAME/'
            'X=${CODEX_HOME}/"; grep -c check_for_update_on_startup.=.false $CODEX_HOME/config.toml; '
            'grep -o base_url.*41400/v1 $CODEX_HOME/config.toml')

    async def go(env):
        async with task_sandbox(handler, task, env) as sandbox:
            config = AgentConfig(agent_kind="harness", agent_command=show, sampling=SamplingParams(max_tokens=8))
            trajectory = await handler.run(task, sandbox, object(), tokenizer=ChatTokenizer(model_dir("tiny")),
                                           config=config, ctx=RolloutContext(job="gw", prompt=0, sample=0))
            assert trajectory.failure.kind.value == "config"  # no model call
            return await sandbox.read_file("/logs/agent/harness.txt")

    defaults = asyncio.run(go(None))
    assert "T=1/A=1/M=claude-sonnet-4-5/W=openai/policy/X=/tmp/.rolloutd-codex/" in defaults, defaults
    assert '1\nbase_url = "http://127.0.0.1:41400/v1' in defaults, defaults
    mine = asyncio.run(go({"DISABLE_TELEMETRY": "", "ANTHROPIC_MODEL": "my-model"}))
    assert "T=/A=1/M=my-model/" in mine, mine
