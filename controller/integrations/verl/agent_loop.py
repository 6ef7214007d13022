"""verl's agent loop "rolloutd": each dataset row verl hands its agent-loop worker becomes one rollout of its
group on a rolloutd batch job, returned as verl's `AgentLoopOutput` token for token (never re-tokenized).

Where it sits: in verl's `AgentLoopWorker` (the trainer's own venv, `pip install 'rolloutd[verl]'`), selected per
row by `agent_name: rolloutd`; `samples.GroupSource` fetches the groups, `servers.py` is the driver's side.
"""
from __future__ import annotations

import asyncio
from typing import Any

from verl.experimental.agent_loop.agent_loop import (AgentLoopBase, AgentLoopMetrics, AgentLoopOutput,
                                                     _agent_loop_registry, register)

from rolloutd.client import AsyncRolloutClient
from rolloutd.client.connection import ClientSettings

from ..samples import GroupSource, Sample, split

# one client and group source per (event loop, job), shared by the loop instances verl makes per sample
_sources: dict[tuple[int, str | None, str | None, str], GroupSource] = {}
# the group of each verl uid being handed out: (the fetch, how many of its samples were taken)
_pending: dict[tuple[str, str], list[Any]] = {}


def to_output(sample: Sample) -> AgentLoopOutput:
    """One rolloutd sample as verl's output. `extra_fields`: the per-token policy versions
    (`rolloutd_versions`, None on observation tokens), verl's own staleness fields `min_global_steps` /
    `max_global_steps` (the oldest and newest version that generated a token) and the stored record's id
    (`rolloutd_trajectory`: job, prompt, group, sample, taskId)."""
    numeric = [v for v in sample.versions if isinstance(v, int)]
    extra = {"rolloutd_versions": sample.versions, "rolloutd_trajectory": sample.key,
             "rolloutd_finish_reason": sample.finish_reason,
             "min_global_steps": min(numeric) if numeric else None, "max_global_steps": max(numeric) if numeric else None}
    return AgentLoopOutput(prompt_ids=sample.prompt_ids, response_ids=sample.response_ids,
                           response_mask=sample.response_mask, response_logprobs=sample.logprobs,
                           reward_score=sample.reward, num_turns=1 + sample.turns + sample.observations,
                           metrics=AgentLoopMetrics(), extra_fields=extra)


class RolloutdAgentLoop(AgentLoopBase):
    """Rows with `agent_name: rolloutd`. A row's `extra_info.index` (verl's `index`) is its prompt index in the
    rolloutd job's dataset; the `rollout.n` copies of a row (one verl `uid`) are one rolloutd group, fetched once
    and handed out sample by sample. Infra failures never reach verl: `GroupSource` replaces them with usable
    samples of fresh groups of the same prompt, or raises `NoUsableSample` (the step fails; never a reward 0).

    Settings (the agent-loop config file's entry, else the environment): `job` (ROLLOUTD_JOB), `server`
    (ROLLOUTD_SERVER), `token_file` (ROLLOUTD_TOKEN_FILE), `samples` (default `rollout.n`), `max_replacements`,
    `timeout`."""

    def __init__(self, *args: Any, job: str | None = None, server: str | None = None, token_file: str | None = None,
                 samples: int | None = None, max_replacements: int = 2, timeout: float = 3600.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.job = job or ClientSettings.from_env().job or ""
        if not self.job:
            raise ValueError("agent loop 'rolloutd' needs a job: `job:` in its agent-loop config entry or ROLLOUTD_JOB")
        self.server, self.token_file = server, token_file  # None: the client's own settings (ROLLOUTD_SERVER, …)
        self.samples = int(samples or self.rollout_config.n)
        self.max_replacements, self.timeout = int(max_replacements), float(timeout)

    def _source(self) -> GroupSource:
        key = (id(asyncio.get_running_loop()), self.server, self.token_file, self.job)
        if key not in _sources:
            client = AsyncRolloutClient(self.server, token_file=self.token_file)
            _sources[key] = GroupSource(client, self.job, max_replacements=self.max_replacements, timeout=self.timeout)
        return _sources[key]

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        if "index" not in kwargs:
            raise KeyError("agent loop 'rolloutd' needs the row's extra_info.index (its prompt index in the job)")
        prompt, uid = int(kwargs["index"]), str(kwargs.get("uid") or kwargs["index"])
        key = (self.job, uid)
        if key not in _pending:
            _pending[key] = [asyncio.ensure_future(self._source().group(prompt, self.samples)), 0]
        entry = _pending[key]
        taken = entry[1]
        entry[1] += 1
        if entry[1] >= self.samples:  # the uid's last copy: a further one would start a new group
            del _pending[key]
        group = await entry[0]
        sample = split(group[taken])
        limits = self.rollout_config
        if len(sample.prompt_ids) > limits.prompt_length or len(sample.response_ids) > limits.response_length:
            raise ValueError(f"trajectory {sample.key}: prompt {len(sample.prompt_ids)} / response "
                             f"{len(sample.response_ids)} tokens exceed verl's rollout.prompt_length "
                             f"{limits.prompt_length} / response_length {limits.response_length}; raise them, or "
                             "lower the job's token limits (verl would not truncate them honestly)")
        return to_output(sample)


# verl's registry: agent name "rolloutd". An entry of the agent-loop config file (with the job's settings) is read
# before this module is imported (hydra imports it for that entry), so it must not be overwritten here.
if "rolloutd" not in _agent_loop_registry:
    register("rolloutd")(RolloutdAgentLoop)
