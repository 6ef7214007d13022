"""The token-in/token-out LLM client's interface: `LLMBackend`, the `Generation` it returns and its failure classes.

Where it sits: the agent loop (agents/loop/run.py) calls `generate(prompt_ids, sampling, request_id)`
once per turn on the backend the scheduler pinned to the task, and `abort(request_id)` when the
rollout is cancelled (DAPO surplus, job deleted). The implementation is vLLM's client,
`agents/vllm_backend.py` (`VLLMBackend`): the daemon builds one per backend URL and shares it between rollouts.

Failure classes: `BackendError` is an *infrastructure* failure (timeout, connection loss, 5xx, a
request the server dropped): the rollout is retried or excluded, never scored; `unreachable` says
the server did not answer at all (the caller may wait for it: `VLLMBackend.wait_healthy`). `RequestRejected`
(HTTP 400/404/422 other than a context overflow) is the job's *configuration*: never scored, it
fails the job. A context overflow is not an error: it is a normal truncated ending
(`finish_reason="length"`, possibly no tokens; the agent loop treats "no room for the first turn"
as a configuration error).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from rolloutd.agents.sampling import SamplingParams, derive_seed  # noqa: F401 - imported from here too
from rolloutd.crds.errors import ConfigurationError, InfraError


@dataclass
class Generation:
    """One turn's output: exactly the generated ids, one logprob per id."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_token_ids: list[int] | None = None
    cached_tokens: int | None = None
    stop_reason: int | str | None = None
    # run-length policy versions over `token_ids` [(version, count), ...] when the caller recorded them (llmgate)
    versions: list[tuple[int | str | None, int]] | None = None
    # seconds from the request to its first generated token arriving (llmgate, streamed); None when not measured
    first_token_seconds: float | None = None
    # the engine's stamps over `token_ids`: [(weights label, start, end)] (token endpoint, final piece); None: none
    weight_spans: list[tuple[str, int, int]] | None = None


class BackendError(InfraError):
    """Infrastructure failure talking to an LLM backend (never a reward). `unreachable`: the server
    did not answer (refused, reset, closed, connect timeout), as when it is down or restarting."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class Preempted(BackendError):
    """The server aborted the request (vLLM's `/pause?mode=abort`, `/abort_requests`) or refused it while paused
    (HTTP 503): `partial` holds the ids and logprobs of the piece that carried the abort (the caller kept the
    pieces before it), so a weight update in abort mode can continue the generation on the new weights."""

    def __init__(self, message: str, partial: "Generation | None" = None) -> None:
        super().__init__(message)
        self.partial = partial


class RequestRejected(ConfigurationError):
    """The backend refused the request as invalid (the job's sampling fields or model name): a
    configuration error, neither the policy's nor the infrastructure's."""

    @property
    def field(self) -> str:
        """The spec field the refusal points at: a token id the model lacks is the tokenizer's fault."""
        return "spec.llm.tokenizer" if _VOCABULARY.search(str(self)) else "spec.agent.sampling"


_VOCABULARY = re.compile(r"out of vocabulary|token id", re.IGNORECASE)


@runtime_checkable
class LLMBackend(Protocol):
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str) -> Generation: ...

    async def abort(self, request_id: str) -> None: ...

    # optional: `stream(prompt_ids, sampling, request_id)`, an async iterator of `Generation` pieces (the ids and
    # logprobs produced since the last piece; the last piece carries the finish reason); the gateway streams with it
