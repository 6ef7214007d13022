"""Rollouts of a rolloutd batch job as a trainer's samples: n usable trajectories per prompt (infra failures
replaced by fresh rollouts of the same prompt, never scored), each split into prompt and response token for token.

Shared by `integrations.verl` (one agent-loop call = one sample) and `integrations.skyrl` (one generator call =
a whole batch). Pure Python (no torch): the ids, masks and logprobs are the trajectories' own.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from rolloutd.crds.errors import InfraError
from rolloutd.client import AsyncRolloutClient, WaitTimeout

log = logging.getLogger("rolloutd.integrations")


class NoUsableSample(InfraError, RuntimeError):
    """A prompt's rollouts kept failing on infrastructure: the trainer gets an error, never a made-up reward."""


def usable(t: dict[str, Any]) -> bool:
    """A trajectory a trainer may score: it has a reward, is not an infra failure, and is one token sequence."""
    return (t.get("reward") is not None and (t.get("failure") or {}).get("kind") != "infra"
            and len(t.get("segments") or []) <= 1 and bool(t.get("tokenIds")))


def token_versions(t: dict[str, Any]) -> list[int | str | None]:
    """The policy version of each response token (None on observation tokens).

    From the record's per-token `versionSpans` (issue #38: runs [start, end) of tokenIds, each sampled by one
    version; a turn the weights changed in holds several) when it carries them; for records without them,
    turn i's generated tokens carry `policyVersions[i]` (one entry per LLM call), or the trajectory's
    `policyVersion` when the two lists do not line up. A version never announced is 0."""
    p, n = int(t.get("promptLength") or 0), len(t.get("tokenIds") or [])
    out: list[int | str | None] = [None] * (n - p)
    spans = [(s.get("version"), int(s["start"]), int(s["end"])) for s in t.get("versionSpans") or []]
    if not spans:
        turns, versions = t.get("turns") or [], list(t.get("policyVersions") or [])
        if len(versions) != len(turns):
            versions = [t.get("policyVersion")] * len(turns)
        spans = [(v, int(turn["generatedStart"]), int(turn["generatedEnd"])) for turn, v in zip(turns, versions)]
    for v, start, end in spans:
        for i in range(max(start, p), min(end, n)):
            out[i - p] = 0 if v is None else v
    return out


@dataclass
class Sample:
    """One trajectory as prompt + response: `response_mask` 1 on generated tokens, 0 on tool observations;
    `logprobs` the engine's on generated tokens, 0.0 elsewhere; `versions` per response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    logprobs: list[float]
    reward: float
    versions: list[int | str | None]
    finish_reason: str
    turns: int  # assistant turns
    observations: int  # tool observations among them
    key: dict[str, Any] = field(default_factory=dict)  # job, prompt, group, sample, taskId: the stored record's id


def split(t: dict[str, Any]) -> Sample:
    """A usable trajectory (see `usable`) as a `Sample`; refuses one whose fields do not line up."""
    ids, mask, lps = list(t["tokenIds"]), list(t["lossMask"]), list(t["logprobs"])
    p = int(t.get("promptLength") or 0)
    where = f"trajectory {t.get('taskId')}#{t.get('sample')}"
    if not (len(ids) == len(mask) == len(lps)) or not 0 < p < len(ids):
        raise ValueError(f"{where}: tokenIds/lossMask/logprobs lengths {len(ids)}/{len(mask)}/{len(lps)}, "
                         f"promptLength {p}")
    if any(mask[:p]):
        raise ValueError(f"{where}: lossMask covers prompt tokens")
    if any(m and lp is None for m, lp in zip(mask, lps)):
        raise ValueError(f"{where}: a generated token has no logprob")
    return Sample(prompt_ids=ids[:p], response_ids=ids[p:], response_mask=[1 if m else 0 for m in mask[p:]],
                  logprobs=[float(lp) if m else 0.0 for m, lp in zip(mask[p:], lps[p:])], reward=float(t["reward"]),
                  versions=token_versions(t), finish_reason=str(t.get("finishReason") or ""),
                  turns=len(t.get("turns") or []),
                  observations=sum(1 for turn in t.get("turns") or [] if turn.get("observationStart") is not None),
                  key={k: t.get(k) for k in ("job", "prompt", "group", "sample", "taskId")})


class GroupSource:
    """n usable trajectories per prompt from a batch job (`spec.batches`, `samplesPerPrompt` = the trainer's n).

    `groups(prompts, n)` asks for exactly those prompts as one batch and waits; a sample that failed on
    infrastructure (or has no record) is replaced by a usable sample of a fresh batch of the prompts still short,
    at most `max_replacements` rounds, after which `NoUsableSample` is raised. So a trainer never sees an infra
    failure as a reward, and its GRPO groups stay full. A job serves one batch at a time: calls queue on a lock.
    `group(prompt, n)` is one prompt's share of a batch made of every prompt asked for in the same turn of the
    event loop (verl asks row by row). `replaced` counts the replacements, `failures` keeps what was left out."""

    def __init__(self, client: AsyncRolloutClient, job: str, *, max_replacements: int = 2, timeout: float = 3600.0):
        self.client, self.job, self.max_replacements, self.timeout = client, job, max_replacements, timeout
        self.replaced = 0
        self.failures: list[dict[str, Any]] = []
        self._n: int | None = None
        self._lock = asyncio.Lock()
        self._waiting: list[tuple[int, int, asyncio.Future]] = []

    async def _check_n(self, n: int) -> None:
        if self._n is None:
            self._n = int((await self.client.get(self.job))["spec"].get("samplesPerPrompt", 1))
        if self._n != n:
            raise ValueError(f"rolloutjob {self.job} runs samplesPerPrompt={self._n}, but the trainer wants {n} "
                             "samples per prompt")

    async def _batch(self, prompts: Sequence[int]) -> list[list[dict[str, Any]]]:
        k = int((await self.client.request_batch(self.job, prompts=list(prompts)))["batch"])
        batch = await self.client.batch(self.job, k, wait=True, timeout=self.timeout, all_groups=True)
        if not batch.complete:
            raise WaitTimeout(f"batch {k} of rolloutjob {self.job}: {len(batch.groups)} groups after "
                              f"{self.timeout:g}s", batch)
        if [g.prompt for g in batch.groups] != list(prompts):
            raise RuntimeError(f"batch {k} of rolloutjob {self.job} holds prompts {[g.prompt for g in batch.groups]}, "
                               f"not the requested {list(prompts)}")
        return [sorted(g.samples, key=lambda t: int(t.get("sample", 0))) for g in batch.groups]

    async def groups(self, prompts: Sequence[int], n: int) -> list[list[dict[str, Any]]]:
        prompts = list(prompts)
        if len(set(prompts)) != len(prompts):
            raise ValueError(f"prompts {prompts} repeat: one group per prompt and batch")
        await self._check_n(n)
        async with self._lock:
            kept: dict[int, list[dict[str, Any]]] = {p: [] for p in prompts}
            short = prompts
            for round_ in range(self.max_replacements + 1):
                if round_:
                    log.warning("rolloutjob %s: prompts %s lack samples without an infrastructure failure; asking "
                                "for fresh groups", self.job, short)
                for p, samples in zip(short, await self._batch(short)):
                    take = [t for t in samples if usable(t)][:n - len(kept[p])]
                    self.failures += [t for t in samples if not usable(t)]
                    self.replaced += len(take) if round_ else 0
                    kept[p] += take
                short = [p for p in prompts if len(kept[p]) < n]
                if not short:
                    return [kept[p] for p in prompts]
        raise NoUsableSample(f"rolloutjob {self.job} prompts {short}: fewer than {n} samples without an "
                             f"infrastructure failure after {self.max_replacements} fresh groups")

    async def group(self, prompt: int, n: int) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiting.append((prompt, n, fut))
        if len(self._waiting) == 1:
            loop.call_soon(self._flush)
        return await fut

    def _flush(self) -> None:
        """Every prompt asked for since the last flush, as batches of distinct prompts (and one n)."""
        waiting, self._waiting = self._waiting, []
        while waiting:
            round_, rest, seen = [], [], set()
            for w in waiting:
                (rest if (w[0] in seen or w[1] != waiting[0][1]) else round_).append(w)
                seen.add(w[0])
            asyncio.ensure_future(self.groups([p for p, _, _ in round_], round_[0][1])).add_done_callback(
                lambda task, round_=round_: _settle(task, round_))
            waiting = rest


def _settle(task: asyncio.Task, waiting: list[tuple[int, int, asyncio.Future]]) -> None:
    for i, (_, _, fut) in enumerate(waiting):
        if fut.done():
            continue
        if task.cancelled():
            fut.cancel()
        elif task.exception() is not None:
            fut.set_exception(task.exception())
        else:
            fut.set_result(task.result()[i])
