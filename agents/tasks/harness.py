"""RUN for `agent.kind: harness`: a black-box agent command in the sandbox, its LLM calls through the
per-rollout gateway (agents/gateway/server.py), the trajectory stitched from the recorded calls.

Where it sits: called by a handler's `run` (agents/tasks/harbor.py) with the rollout's sandbox, its
pinned LLM and the job's tokenizer; EVAL then scores the sandbox as for any agent. The harness sees
`OPENAI_BASE_URL=http://127.0.0.1:PORT/v1` and `ANTHROPIC_BASE_URL=http://127.0.0.1:PORT` (a relay on the
sandbox's own loopback to the gateway's socket in /.rolloutd: the sandbox still has no network), placeholder
`OPENAI_API_KEY` / `ANTHROPIC_API_KEY` / `ANTHROPIC_AUTH_TOKEN` (`harness_env`), each known harness's offline
defaults unless the sandbox's environment (`spec.sandbox.env`) names them (`HARNESS_DEFAULTS`, `offline_prelude`),
the instruction on stdin and in `$ROLLOUTD_INSTRUCTION_FILE`; its output goes to /logs/agent/harness.txt.

Trajectory: one sequence (every call extended the previous tokens) fills `token_ids` / `loss_mask` /
`logprobs` / `turns`; when the harness rewrote its history the flat fields stay empty and
`Trajectory.segments` holds every sequence (never a silently re-tokenized one), as few as the ids allow
(a call extending any earlier sequence continues it); `metrics.segments` and `metrics.retokenized_tokens`
say how many sequences and how many prompt ids came from re-sent or rewritten text. A backend error
behind any call makes the rollout `infra`; a call the backend refuses as invalid, `config` (the gateway
checks the harness's part of a request first, so what is left is the job's sampling). A prompt over the job's
token budget (`maxTotalTokens`, refused by the gateway before the engine) is `config` when it is the harness's
first call (the task and the harness's own prompt do not fit the budget: the job must declare one that does) and
`agent` after (the conversation outgrew the budget: the agent loop's "token limit").
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from rolloutd.agents.gateway.server import Gateway, start_relay, stitch
from rolloutd.crds.trajectory import Failure, FailureKind, Segment, Trajectory, Turn, VersionSpan

from .base import stash_answer
from .seams import LLM, AgentConfig, HostSandbox, RolloutContext, Sandbox, Tokenizer

PORT = 41400          # on the sandbox's private loopback: no clash between sandboxes
SESSION = {"session": "rolloutd-gateway"}
INSTRUCTION = "/tmp/.harbor/instruction.md"


async def run_harness(task: dict, sandbox: HostSandbox, llm: LLM | None, *, tokenizer: Tokenizer | None,
                      config: AgentConfig, ctx: RolloutContext,
                      workdir: str, timeout: float) -> Trajectory:
    gateway = Gateway(llm, tokenizer, config.sampling, seed_parts=(ctx.prompt, ctx.sample),
                      request_prefix=f"{ctx.job}-{ctx.prompt}-{ctx.sample}-{ctx.attempt}-gw",
                      max_total_tokens=config.max_total_tokens)
    await gateway.start(Path(sandbox.root) / "ctl" / "gateway.sock")  # uvicorn makes it 0666, in a 0700 dir
    try:
        await sandbox.write_file(INSTRUCTION, task["instruction"])
        await start_relay(sandbox, "/.rolloutd/gateway.sock", PORT, "/tmp/.harbor/relay.log", SESSION)
        env = {**harness_env(PORT), "ROLLOUTD_INSTRUCTION_FILE": INSTRUCTION}
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items()) + offline_prelude()
        result = await sandbox.bash(f"{exports}cd {shlex.quote(workdir)} && ({config.agent_command}) < {INSTRUCTION} "
                                    f"> /logs/agent/harness.txt 2>&1; echo \"harness-exit=$?\"", timeout=timeout)
        # no model call: the harness's own words say why (a login prompt, an unknown model, a missing key)
        printed = "" if gateway.calls else await _tail(sandbox, "/logs/agent/harness.txt")
    finally:
        await gateway.stop()
    return _trajectory(gateway, tokenizer, ctx, result, printed)


async def _tail(sandbox: Sandbox, path: str) -> str:
    try:
        return (await sandbox.bash(f"tail -c 400 {path}", session="tail", timeout=10)).output
    except Exception:  # noqa: BLE001 - the reason is worth having, not worth failing the rollout over
        return ""


def harness_env(port: int) -> dict[str, str]:
    """Where each client finds the gateway, by its own convention: OpenAI's with `/v1`, Anthropic's without (its
    SDK adds `/v1/messages`); the keys are placeholders each client insists on (the socket is the boundary)."""
    base = f"http://127.0.0.1:{port}"
    return {"OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_BASE": f"{base}/v1", "OPENAI_API_KEY": "rolloutd",
            "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "rolloutd", "ANTHROPIC_AUTH_TOKEN": "rolloutd"}


# What each known harness needs to run offline and quietly against the gateway, by its own variables: no telemetry,
# error reports, update checks or side calls, and a model name it accepts (the gateway serves the policy whatever
# the name). Defaults only: a variable the sandbox's environment sets (`spec.sandbox.env`, even empty) or the
# command exports wins. Documented in docs/content/tasks.md; run with each real harness in
# tests/agents/test_gateway_harnesses.py.
HARNESS_DEFAULTS: dict[str, dict[str, str]] = {
    "Claude Code": {
        "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_BUG_COMMAND": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
        "ANTHROPIC_MODEL": "claude-sonnet-4-5", "ANTHROPIC_SMALL_FAST_MODEL": "claude-haiku-4-5",
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": "claude-haiku-4-5",
        "IS_SANDBOX": "1",  # --dangerously-skip-permissions as root: rolloutd's sandbox is the sandbox
        "API_TIMEOUT_MS": "600000",  # a CPU engine answers a first prompt of ~50 000 tokens slowly
    },
    "mini-swe-agent (litellm)": {
        "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1", "MSWEA_COST_TRACKING": "ignore_errors",
        "MSWEA_MODEL_NAME": "openai/policy", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    },
}

# Codex CLI reads its provider, update check and analytics from `$CODEX_HOME/config.toml` only: without a
# CODEX_HOME of the sandbox's and a ~/.codex/config.toml of the image's, one pointing at the gateway is written.
CODEX_HOME = "/tmp/.rolloutd-codex"
CODEX_CONFIG = ('model = "policy"\nmodel_provider = "rolloutd"\ncheck_for_update_on_startup = false\n'
                '[analytics]\nenabled = false\n[model_providers.rolloutd]\nname = "rolloutd"\nbase_url = "%s"\n'
                'env_key = "OPENAI_API_KEY"\nwire_api = "responses"\nrequest_max_retries = 0\n'
                'stream_max_retries = 0\n')


def offline_prelude() -> str:
    """The shell lines setting `HARNESS_DEFAULTS` where unset and the Codex config where absent (after
    `harness_env`'s exports: the Codex config names `$OPENAI_BASE_URL`)."""
    lines = [f'export {k}="${{{k}-{v}}}"; ' for vars_ in HARNESS_DEFAULTS.values() for k, v in vars_.items()]
    lines.append('mkdir -p "$HOME" 2>/dev/null; ')
    lines.append(f'if [ -z "${{CODEX_HOME-}}" ] && [ ! -e "$HOME/.codex/config.toml" ]; then export CODEX_HOME={CODEX_HOME}; '
                 f'mkdir -p "$CODEX_HOME" && printf {shlex.quote(CODEX_CONFIG)} "$OPENAI_BASE_URL" > "$CODEX_HOME/config.toml"; fi; ')
    return "".join(lines)


def _trajectory(gateway: Gateway, tokenizer: Tokenizer | None, ctx: RolloutContext, result: Any, printed: str = "") -> Trajectory:
    segments = stitch(gateway.calls, decode=tokenizer.decode if tokenizer is not None else None)  # None: no LLM
    t = Trajectory(job=ctx.job, prompt=ctx.prompt, sample=ctx.sample, task_id=ctx.task_id, node=ctx.node,
                   attempt=ctx.attempt, backend=ctx.backend, finish_reason="harness")
    sequences = [Segment(token_ids=s.token_ids, prompt_length=s.prompt_length, loss_mask=s.loss_mask,
                         logprobs=s.logprobs, calls=s.calls, drift=s.drift,
                         turns=[Turn(generated_start=a, generated_end=b, finish_reason=f) for a, b, f in s.turns],
                         version_spans=[VersionSpan(version=v, start=a, end=b) for v, a, b in s.versions if b > a])
                 for s in segments]
    if len(sequences) == 1:
        one = sequences[0]
        t.token_ids, t.loss_mask, t.logprobs, t.prompt_length, t.turns, t.version_spans = (
            one.token_ids, one.loss_mask, one.logprobs, one.prompt_length, one.turns, one.version_spans)
    else:
        t.segments = sequences
    t.metrics = {
        "gateway_calls": len(gateway.calls),
        "drifted_segments": sum(s.drift for s in segments),
        # token-exact whatever the harness did to its history: how many sequences the trainer gets, and how
        # many prompt ids came from re-tokenized (re-sent or rewritten) text rather than from a recorded sequence
        "segments": len(segments),
        "retokenized_tokens": sum(s.retokenized for s in segments),
        "harness_timed_out": bool(result.timed_out),
        "harness_output": result.output[-1000:],
    }
    error = gateway.backend_error
    if error:
        t.failure = Failure(kind=FailureKind.infra, reason=f"RUN: an LLM call through the gateway failed: {error}")
    elif gateway.over_budget and gateway.over_budget_first:
        t.failure = Failure(kind=FailureKind.config, reason=f"{gateway.over_budget}, and it was the harness's first "
                                                            "call: the job's budget must hold the harness's prompts")
    elif gateway.rejected:
        t.failure = Failure(kind=FailureKind.config, reason="spec.agent.sampling: the backend refused a call "
                                                            f"through the gateway: {gateway.rejected}")
    elif gateway.over_budget:
        t.failure = Failure(kind=FailureKind.agent, reason=f"token limit: {gateway.over_budget}")
    elif not gateway.calls and tokenizer is not None:  # nothing the policy generated: no sample to train on
        printed = " ".join(printed.split())[-300:] or "(nothing)"
        t.failure = Failure(kind=FailureKind.config, reason=(
            "spec.agent.command: the harness made no model call through rolloutd's gateway (its model name or "
            f"offline variables are not the ones the harness needs: see the harness table); it printed: {printed}"))
    elif result.timed_out:
        t.failure = Failure(kind=FailureKind.agent, reason="the harness did not finish within its time")
    return stash_answer(t, submitted=None, final_text="")


__all__ = ["HARNESS_DEFAULTS", "harness_env", "offline_prelude", "run_harness"]
