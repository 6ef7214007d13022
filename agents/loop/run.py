"""The multi-turn agent loop: tokens in, tokens out, tools in the sandbox.

Where it sits: called by a task handler's `run` (agents/tasks/base.py) inside the node daemon's RUN
pool, with the LLM backend the scheduler pinned to the task, the task's sandbox, the model's
`ChatTokenizer`, the job's limits (`AgentConfig`) and the rollout's identity (`RolloutContext`).
Returns an `AgentResult` whose trajectory carries no reward (EVAL scores it later).

Token bookkeeping (the invariant trainers rely on): the chat template is applied once, to the
initial messages. Every later prompt is the previous prompt ids + the generated ids exactly as the
engine returned them + the ids of the templated tool observation. `loss_mask` is 1 exactly on
generated ids; `logprobs` holds the engine's logprob on generated ids and None elsewhere.

Failure classes (the kind is `rolloutd.crds.errors.classify`'s): `BackendError`, a sandbox infrastructure error (`SandboxError` and subclasses
such as `SandboxDied`), a hung sandbox, or the RUN stage timeout -> `infra` (never a reward).
A backend that stops answering (`BackendError.unreachable`: killed, restarting) is waited for
within the RUN budget and the turn is sent again. A prompt with no room for a first turn (over
`maxTotalTokens` or the model's context) or a request the backend refuses (`RequestRejected`)
-> `config`: the job's configuration, never a reward (the controller fails the job).
Turn limit without a final answer, token limit, a truncated turn -> `agent` (a legitimate outcome
the handler may score). A malformed tool call is an error observation, counted in the metrics.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import TYPE_CHECKING, Any

from rolloutd.crds.errors import classify
from rolloutd.crds.trajectory import Failure, FailureKind, Timings, Trajectory, Turn, VersionSpan

from rolloutd.crds.kit import trace_spans
from .. import spans as node_traces
from ..llm import BackendError, LLMBackend, RequestRejected, derive_seed
from ..tokenizer import ChatTokenizer
from ..toolcall_formats import FORMATS, format_for
from .tools import (ToolInfraError, is_infra_error, execute, parse_tool_calls, tool_instructions,
                                        tool_specs)
from .rollout import AgentConfig, AgentResult, RolloutContext

if TYPE_CHECKING:  # the sandbox interface (rolloutd.sandbox.Sandbox); duck-typed at run time
    from rolloutd.sandbox import Sandbox  # noqa: F401


def _reason(e: Exception, run_timeout: float | None, waited: float | None, backend: str | None) -> str:
    """The failure reason of a loop that ended with `e` (the words trajectories have always carried)."""
    if isinstance(e, BackendError):
        return f"LLM backend: {e}"
    if isinstance(e, RequestRejected):
        return f"{e.field}: the backend refused the request: {e}"
    if isinstance(e, ToolInfraError):
        return f"tool execution: {e}"
    if isinstance(e, asyncio.TimeoutError):
        reason = f"RUN stage exceeded {run_timeout:g}s"
        if waited is not None:
            reason += f", the last {waited:.0f}s waiting for the unreachable backend {backend}"
        return reason
    return f"sandbox: {type(e).__name__}: {e}"


def with_tool_instructions(messages: list[dict[str, Any]], tools: list[str]) -> list[dict[str, Any]]:
    """Describe the tools in the system message (for templates that ignore `tools=`)."""
    text = tool_instructions(tools)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content', '')}\n\n{text}".strip()
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def drift_report(tokenizer: ChatTokenizer, ids: list[int]) -> dict[str, Any]:
    """Re-tokenize the decoded sequence and report where it differs from the ids actually used
    (non-canonical tokenizations the model generated; a trainer that re-tokenizes would see these)."""
    again = tokenizer.encode_text(tokenizer.decode(ids))
    positions = [i for i, (a, b) in enumerate(zip(ids, again)) if a != b]
    first = positions[0] if positions else (min(len(ids), len(again)) if len(ids) != len(again) else None)
    return {
        "drift_mismatches": len(positions) + abs(len(ids) - len(again)),
        "drift_first_position": first,
        "drift_positions": positions[:32],
        "drift_length_delta": len(again) - len(ids),
    }


async def run_tool(call: Any, sandbox: "Sandbox | None", timeout: float | None) -> Any:
    """One tool call in the sandbox (`tools.execute`), as an `execute_tool` span when tracing is on."""
    with node_traces.tool_call(call.name) as span:
        started = time.monotonic()
        result = await execute(call, sandbox, timeout)
        node_traces.tool_result(span, result, started)
        return result


async def run_agent_loop(
    messages: list[dict[str, Any]],
    *,
    sandbox: "Sandbox | None",
    llm: LLMBackend,
    tokenizer: ChatTokenizer,
    config: AgentConfig,
    ctx: RolloutContext,
) -> AgentResult:
    """Run one multi-turn rollout; see the module docstring for the token and failure rules."""
    t0 = time.monotonic()
    tools = list(config.tools)
    specs = tool_specs(tools) if tools else None
    fmt = format_for(tokenizer)
    if specs and not tokenizer.supports_tools:
        # the loop describes the tools itself, in the Hermes format
        messages, specs, fmt = with_tool_instructions(messages, tools), None, FORMATS["hermes"]
    conversation = [dict(m) for m in messages]
    prompt_ids = tokenizer.encode_chat(conversation, tools=specs)

    ids: list[int] = list(prompt_ids)
    mask: list[int] = [0] * len(ids)
    logprobs: list[float | None] = [None] * len(ids)
    turns: list[Turn] = []
    spans: list[VersionSpan] = []
    metrics: dict[str, Any] = {
        "turns": 0, "tool_calls": 0, "malformed_tool_calls": 0, "tool_errors": 0,
        "generated_tokens": 0, "observation_tokens": 0, "cached_tokens": 0,
        "llm_seconds": 0.0, "tool_seconds": 0.0,
    }
    failure = Failure()
    submitted: str | None = None
    final_text = ""
    finish: str | None = None
    rid_base = f"{ctx.job}-p{ctx.prompt}-s{ctx.sample}-a{ctx.attempt}-{uuid.uuid4().hex[:8]}"

    task = ctx.task_id if ctx.task_id is not None else f"#{ctx.prompt}"
    outage: list[float] = []  # when the pinned backend stopped answering (empty while it answers)

    def too_long(field: str, limit: int, what: str = "") -> Failure:
        n = len(prompt_ids)
        return Failure(kind=FailureKind.config, reason=f"{field}: the prompt of task {task} has {n} tokens, "
                                                       f"{'more than' if n > limit else 'as many as'} {limit}{what}")

    async def generate(prompt: list[int], sampling: Any, request_id: str) -> Any:
        """One turn; while the backend does not answer, wait for it (the RUN budget bounds this)."""
        tries = 0
        while True:
            try:
                gen = await llm.generate(prompt, sampling, request_id if not tries else f"{request_id}-r{tries}")
                outage.clear()
                return gen
            except BackendError as e:
                wait = getattr(llm, "wait_healthy", None)
                if not e.unreachable or wait is None:
                    raise
                outage[:] = outage or [time.monotonic()]
                metrics["backend_waits"] = metrics.get("backend_waits", 0) + 1
                tries += 1
                bound = config.backend_wait if config.backend_wait is not None else config.run_timeout
                if not await wait(timeout=float("inf") if bound is None else bound):
                    raise

    async def turns_loop() -> None:
        nonlocal failure, submitted, final_text, finish
        for turn in range(config.max_turns):
            turn_span.close()   # the previous turn's
            turn_span.enter_context(trace_spans.span("turn", {"rolloutd.turn": turn}))
            room = config.max_total_tokens - len(ids)
            if room <= 0 and turn == 0:
                failure, finish = too_long("spec.agent.sampling.maxTotalTokens", config.max_total_tokens), "error"
                return
            if room <= 0:
                failure = Failure(kind=FailureKind.agent, reason=f"token limit: {config.max_total_tokens} tokens")
                finish = "length"
                return
            sampling = config.sampling.model_copy(update={
                "max_tokens": min(config.max_tokens_per_turn, room),
                "seed": derive_seed(config.sampling.seed, ctx.prompt, ctx.sample, turn),
            })
            t, began = time.monotonic(), time.time()
            gen = await generate(list(ids), sampling, f"{rid_base}-t{turn}")
            model_seconds = time.monotonic() - t
            metrics["llm_seconds"] += model_seconds
            if turn == 0 and gen.finish_reason == "length" and not gen.token_ids:  # no room in the context
                limit = getattr(llm, "max_model_len", None)
                failure = too_long("spec.llm.backends", limit, f" (the context of the model at {ctx.backend})") \
                    if isinstance(limit, int) else Failure(kind=FailureKind.config, reason=(
                        f"spec.llm.backends: the prompt of task {task} ({len(prompt_ids)} tokens) leaves no room "
                        f"in the context of the model at {ctx.backend}"))
                finish = "error"
                return
            if len(gen.logprobs) != len(gen.token_ids):
                raise BackendError(f"{len(gen.logprobs)} logprobs for {len(gen.token_ids)} ids")
            start = len(ids)
            ids.extend(gen.token_ids)
            mask.extend([1] * len(gen.token_ids))
            logprobs.extend(gen.logprobs)
            metrics["turns"] += 1
            metrics["generated_tokens"] += len(gen.token_ids)
            metrics["cached_tokens"] += gen.cached_tokens or 0
            at = start
            for version, n in getattr(gen, "versions", None) or []:
                spans.append(VersionSpan(version=version, start=at, end=at + n))
                at += n
            record = Turn(generated_start=start, generated_end=len(ids), finish_reason=gen.finish_reason,
                          started=round(began, 6), model_seconds=round(model_seconds, 6),
                          first_token_seconds=getattr(gen, "first_token_seconds", None))
            turns.append(record)
            final_text = tokenizer.decode_content(gen.token_ids)
            conversation.append({"role": "assistant", "content": final_text})

            if gen.finish_reason == "length":
                limit = "token limit" if len(ids) >= config.max_total_tokens else "turn truncated"
                failure = Failure(kind=FailureKind.agent, reason=f"{limit} after {len(gen.token_ids)} tokens")
                finish = "length"
                return
            calls = parse_tool_calls(final_text, tools, fmt)
            if not calls:  # a final answer
                finish = "stop"
                return
            record.tool_calls = [c.wire() for c in calls]
            observations: list[str] = []
            t = time.monotonic()
            for call in calls:
                metrics["tool_calls"] += 1
                if call.error:
                    metrics["malformed_tool_calls"] += 1
                result = await run_tool(call, sandbox, config.action_timeout)
                if not result.ok:
                    metrics["tool_errors"] += 1
                observations.append(result.observation if len(calls) == 1 else f"[{call.name}] {result.observation}")
                if result.submitted is not None:
                    submitted = result.submitted
                    break
            record.tool_seconds = round(time.monotonic() - t, 6)
            metrics["tool_seconds"] += record.tool_seconds
            if submitted is not None:
                finish = "submit"
                return
            if turn == config.max_turns - 1:
                failure = Failure(kind=FailureKind.agent, reason=f"turn limit: {config.max_turns} turns without an answer")
                finish = "max_turns"
                return
            observation = "\n".join(observations)
            closed = bool(gen.token_ids) and gen.token_ids[-1] in tokenizer.eos_token_ids
            obs_ids = tokenizer.encode_observation(observation, closed=closed)
            if len(ids) + len(obs_ids) >= config.max_total_tokens:
                failure = Failure(kind=FailureKind.agent, reason=f"token limit: {config.max_total_tokens} tokens")
                finish = "length"
                return
            record.observation_start = len(ids)
            ids.extend(obs_ids)
            mask.extend([0] * len(obs_ids))
            logprobs.extend([None] * len(obs_ids))
            record.observation_end = len(ids)
            metrics["observation_tokens"] += len(obs_ids)
            conversation.append({"role": tokenizer.observation_role, "content": observation})

    turn_span = contextlib.ExitStack()  # the current turn's span (tracing on)

    async def traced_turns() -> None:
        with turn_span:  # the last turn's span ends in the task that opened it
            await turns_loop()

    try:
        if config.run_timeout is None:
            await traced_turns()
        else:
            await asyncio.wait_for(traced_turns(), config.run_timeout)
    except Exception as e:  # what the loop can name ends the trajectory, classed by `classify`; the rest propagates
        if not isinstance(e, (BackendError, RequestRejected, ToolInfraError, asyncio.TimeoutError)) \
                and not is_infra_error(e):
            raise
        waited = time.monotonic() - outage[0] if outage else None
        failure, finish = Failure(kind=classify(e), reason=_reason(e, config.run_timeout, waited, ctx.backend)), "error"

    if config.drift_check:
        metrics.update(drift_report(tokenizer, ids))
    metrics["llm_seconds"] = round(metrics["llm_seconds"], 4)
    metrics["tool_seconds"] = round(metrics["tool_seconds"], 4)
    run_seconds = time.monotonic() - t0
    trajectory = Trajectory(
        job=ctx.job, prompt=ctx.prompt, sample=ctx.sample, task_id=ctx.task_id,
        token_ids=ids, prompt_length=len(prompt_ids), loss_mask=mask, logprobs=logprobs,
        turns=turns, version_spans=spans, messages=conversation, reward=None, failure=failure, finish_reason=finish,
        policy_version=ctx.policy_version, backend=ctx.backend, node=ctx.node, attempt=ctx.attempt,
        timings=Timings(run=run_seconds), metrics=metrics,
    )
    return AgentResult(trajectory=trajectory, submitted=submitted, final_text=final_text)
