"""The agent loop's contract types: what a task handler passes in and gets back.

Where it sits: task handlers (agents/tasks/) and the node daemon build an `AgentConfig` (from the
RolloutJob spec's limits and sampling) and a `RolloutContext` (which rollout this is) and call
`rolloutd.agents.loop.run.run_agent_loop`, which returns an `AgentResult`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rolloutd.crds.trajectory import Trajectory

from ..llm import SamplingParams
from .tools import TOOL_NAMES


@dataclass
class AgentConfig:
    """Limits and sampling of one rollout.

    - `max_turns`: assistant turns at most (a turn = one generation).
    - `max_tokens_per_turn`: generated tokens per turn at most.
    - `max_total_tokens`: length of the whole token sequence (prompt + generations + observations).
    - `action_timeout`: seconds per tool call (enforced by the sandbox; a timeout is an observation).
    - `run_timeout`: seconds for the whole RUN stage (None = unbounded). Actions are bounded one by
      one, so hitting it means the backend or sandbox is too slow: an infrastructure failure.
    - `drift_check`: re-tokenize the decoded conversation and report mismatches in the metrics.
    - `backend_wait`: seconds to wait for a backend that stopped answering before the turn fails
      as `infra` (None = as long as the RUN budget allows).
    - `agent_kind`: the job's `agent.kind` ("loop": this loop; "oracle": the task's own solution;
      "harness": `agent_command` through agents/gateway/server.py).
    """

    max_turns: int = 4
    max_tokens_per_turn: int = 256
    max_total_tokens: int = 2048
    tools: list[str] = field(default_factory=lambda: list(TOOL_NAMES))
    sampling: SamplingParams = field(default_factory=SamplingParams)
    action_timeout: float = 60.0
    drift_check: bool = False
    run_timeout: float | None = None
    backend_wait: float | None = None
    agent_kind: str = "loop"
    agent_command: str | None = None
    system_prompt: str | None = None  # the job's `agent.systemPrompt`: replaces the task kind's system message


def with_system(messages: list[dict], prompt: str | None) -> list[dict]:
    """`messages` with their system message replaced by `prompt` (added first when there is none); as they are
    when `prompt` is None."""
    if prompt is None:
        return messages
    rest = messages[1:] if messages and messages[0].get("role") == "system" else messages
    return [{"role": "system", "content": prompt}, *rest]


@dataclass
class RolloutContext:
    """Which rollout this is: copied into the trajectory; (prompt, sample, turn) seed the sampling."""

    job: str
    prompt: int
    sample: int
    task_id: str | None = None
    node: str | None = None
    policy_version: int | str | None = None
    backend: str | None = None
    attempt: int = 0


@dataclass
class AgentResult:
    """`trajectory` has reward None; `failure` set for agent or infra failures. `submitted` is the
    submit tool's answer (if called); `final_text` the decoded text of the last assistant turn."""

    trajectory: Trajectory
    submitted: str | None = None
    final_text: str = ""
