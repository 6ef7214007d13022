"""A training batch as the trainer receives it, and its conversion to padded arrays.

Built by the clients (`RolloutClient.batch` / `next_batch`, the async twins) from the server's
`GET …/rolloutjobs/{name}/batches/{k}` answer. `Batch.to_arrays()` turns it into plain Python
lists (or numpy arrays, when asked for and numpy is importable) that a trainer hands to
`torch.tensor(...)`; nothing here imports torch or numpy at import time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class Group:
    """One GRPO group: `samples` (trajectory wire dicts, camelCase as on the API) of one prompt.

    `group` is the server's group id, `prompt` the dataset index, `state` one of
    `counted` (part of the batch), `uninformative`, `incomplete`, `cancelled`, `running`.
    `rewards[i]` is `samples[i]["reward"]` (`None` for an infrastructure failure), aligned with
    `samples` (the server's own `rewards` list leaves infrastructure failures out)."""

    group: Any
    prompt: int
    samples: list[dict[str, Any]]
    rewards: list[float | None]
    state: str = "counted"

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Group":
        samples = list(d.get("samples") or [])
        rewards = [s.get("reward") for s in samples] if samples else list(d.get("rewards") or [])
        return cls(group=d.get("group"), prompt=d.get("prompt", -1), samples=samples, rewards=list(rewards),
                   state=d.get("state", "counted"))


@dataclass
class Batch:
    """One batch of a batch-server job (`spec.dapo.enabled` or `spec.batches`); batches are
    numbered from 1.

    `groups` holds the counted groups only (what to train on), unless the batch was fetched with
    `all_groups=True`. Counters come from the server: `cancelled_rollouts` (surplus rollouts
    cancelled on the daemons once the batch was full), `never_started`, `saved_tokens_estimate`,
    `seconds_to_fill`, `opened_groups` (groups started for it, DAPO replacements included),
    `policy_versions` (of the trajectories in it). `raw` is the server's answer as received."""

    batch: int
    state: str
    target: int
    counted: int
    groups: list[Group] = field(default_factory=list)
    cancelled_rollouts: int = 0
    never_started: int = 0
    saved_tokens_estimate: int = 0
    seconds_to_fill: float | None = None
    opened_groups: int = 0
    policy_versions: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> "Batch":
        return cls(batch=d["batch"], state=d.get("state", "running"), target=d.get("target", 0),
                   counted=d.get("counted", 0), groups=[Group.from_wire(g) for g in d.get("groups") or []],
                   cancelled_rollouts=d.get("cancelledRollouts", 0), never_started=d.get("neverStarted", 0),
                   saved_tokens_estimate=d.get("savedTokensEstimate", 0), seconds_to_fill=d.get("secondsToFill"),
                   opened_groups=d.get("openedGroups", 0), policy_versions=list(d.get("policyVersions") or []),
                   raw=d)

    @property
    def complete(self) -> bool:
        return self.state == "complete"

    @property
    def trajectories(self) -> list[dict[str, Any]]:
        return [s for g in self.groups for s in g.samples]

    @property
    def infra_failures(self) -> int:
        """Rows `to_arrays` leaves out: samples without a reward (infrastructure failures)."""
        return sum(1 for g in self.groups for s in g.samples if not _usable(s))

    def to_arrays(self, pad_id: int = 0, pad_to: int | None = None, eps: float = 1e-4,
                  numpy: bool = False) -> dict[str, Any]:
        """The batch as equal-length rows, one row per token sequence of each usable trajectory (one, or one
        per entry of its `segments` when its agent rewrote its history: see `sequences`), in group order.

        A trajectory is usable when its `reward` is not None and its `failure.kind` is not
        `infra`; the others (infrastructure failures: never a reward, never a 0) are left out and
        counted by `Batch.infra_failures`. With N usable rows and T = `pad_to` (or the longest
        `tokenIds`; a row longer than `pad_to` raises ValueError — truncating would cut the
        generated tokens the rewards belong to):

        - `input_ids` [N][T] int: `tokenIds` (prompt, every generated turn and every tool
          observation, token-exact as the engine saw them), right-padded with `pad_id`.
        - `attention_mask` [N][T] int: 1 on real tokens, 0 on padding.
        - `loss_mask` [N][T] int: 1 exactly on tokens the policy generated (the trajectory's
          `lossMask`), 0 on prompt, observation and padding tokens.
        - `rollout_logprobs` [N][T] float: the sampling logprob of each generated token as
          reported by the engine; 0.0 wherever `loss_mask` is 0.
        - `rewards` [N] float: the trajectory's scalar reward.
        - `advantages` [N] float: GRPO outcome advantage per group over its usable rows,
          (r − mean) / (std + eps) with the sample standard deviation (n − 1, like
          `torch.std`); 0.0 for every row of a group with fewer than two usable rows. Broadcast
          it over `loss_mask` for a token-level advantage.
        - `group_index` [N] int: index of the row's group in `self.groups` (0 … G−1).
        - `prompt_index` [N] int: the dataset index of the row's prompt.
        - `sample_index` [N] int: the sample number within its group.
        - `segment_index` [N] int: which of the trajectory's sequences the row is (0 for a single one);
          every row of a trajectory carries its reward and advantage.
        - `prompt_lengths` [N] int: tokens before the first generated token (`promptLength`).
        - `response_lengths` [N] int: generated tokens (sum of `loss_mask`).
        - `policy_versions` [N]: the policy version of the row's first turn (`policyVersion`;
          None when never announced). Per-turn versions stay in the trajectory's `policyVersions`.
        - `token_versions` [N][T]: the policy version that sampled each generated token (from the sequence's
          `versionSpans`: a turn the weights changed in holds two or more), None elsewhere and where the
          daemon recorded no spans. With `numpy=True` and integer versions: int64, -1 for None.

        With `numpy=True` (numpy must be importable) the 2-D and numeric arrays are numpy arrays:
        int64 for ids and masks, float32 for logprobs, rewards and advantages.
        """
        rows: list[tuple[int, dict[str, Any], dict[str, Any], int]] = []
        advantages: list[float] = []
        for gi, g in enumerate(self.groups):
            usable = [s for s in g.samples if _usable(s)]
            for s, adv in zip(usable, grpo_advantages([float(s["reward"]) for s in usable], eps)):
                for j, seq in enumerate(sequences(s)):
                    rows.append((gi, s, seq, j))
                    advantages.append(adv)
        longest = max((len(seq.get("tokenIds") or []) for _, _, seq, _ in rows), default=0)
        if pad_to is not None and pad_to < longest:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest trajectory ({longest} tokens)")
        width = pad_to if pad_to is not None else longest
        out: dict[str, list] = {k: [] for k in (
            "input_ids", "attention_mask", "loss_mask", "rollout_logprobs", "rewards", "advantages", "group_index",
            "prompt_index", "sample_index", "segment_index", "prompt_lengths", "response_lengths", "policy_versions",
            "token_versions")}
        for (gi, s, seq, j), adv in zip(rows, advantages):
            ids = list(seq.get("tokenIds") or [])
            n, pad = len(ids), width - len(ids)
            logprobs = seq.get("logprobs") or [None] * n
            mask = seq.get("lossMask") or [0 if lp is None else 1 for lp in logprobs]
            mask = [1 if m else 0 for m in mask]
            lps = [float(lp) if m and lp is not None else 0.0 for m, lp in zip(mask, logprobs)]
            out["input_ids"].append(ids + [pad_id] * pad)
            out["attention_mask"].append([1] * n + [0] * pad)
            out["loss_mask"].append(mask + [0] * pad)
            out["rollout_logprobs"].append(lps + [0.0] * pad)
            out["rewards"].append(float(s["reward"]))
            out["advantages"].append(adv)
            out["group_index"].append(gi)
            out["prompt_index"].append(s.get("prompt", self.groups[gi].prompt))
            out["sample_index"].append(s.get("sample", 0))
            out["segment_index"].append(j)
            out["prompt_lengths"].append(seq.get("promptLength", 0))
            out["response_lengths"].append(sum(mask))
            out["policy_versions"].append(s.get("policyVersion"))
            out["token_versions"].append(token_versions(seq, width))
        if not numpy:
            return out
        try:
            import numpy as np
        except ImportError:
            raise ImportError("to_arrays(numpy=True) needs numpy; call to_arrays() for plain lists") from None
        conv: dict[str, Any] = dict(out)
        for k in ("input_ids", "attention_mask", "loss_mask", "group_index", "prompt_index", "sample_index",
                  "segment_index", "prompt_lengths", "response_lengths"):
            conv[k] = np.asarray(out[k], dtype=np.int64).reshape((len(rows), width) if k in (
                "input_ids", "attention_mask", "loss_mask") else (len(rows),))
        for k in ("rollout_logprobs", "rewards", "advantages"):
            conv[k] = np.asarray(out[k], dtype=np.float32).reshape(
                (len(rows), width) if k == "rollout_logprobs" else (len(rows),))
        flat = [v for row in out["token_versions"] for v in row if v is not None]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            conv["token_versions"] = np.asarray([[-1 if v is None else v for v in row] for row in out["token_versions"]],
                                                dtype=np.int64).reshape((len(rows), width))
        return conv


def token_versions(seq: dict[str, Any], width: int) -> list[Any]:
    """One sequence's `versionSpans` as one version per position (None outside every span), `width` long."""
    row: list[Any] = [None] * width
    for span in seq.get("versionSpans") or []:
        for i in range(max(span.get("start", 0), 0), min(span.get("end", 0), width)):
            row[i] = span.get("version")
    return row


def sequences(trajectory: dict[str, Any]) -> list[dict[str, Any]]:
    """A trajectory's token sequences (wire dicts with tokenIds, promptLength, lossMask, logprobs, turns):
    its `segments` when it has several (a harness rewrote its history), else the trajectory itself."""
    return list(trajectory.get("segments") or []) or [trajectory]


def grpo_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """(r − mean) / (sample std + eps) over one group; all 0.0 for fewer than two rewards."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]


def _usable(s: dict[str, Any]) -> bool:
    return s.get("reward") is not None and (s.get("failure") or {}).get("kind") != "infra"
