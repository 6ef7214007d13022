"""What the simulated nodes were told and what the controller delivered: `Ledger` records the leases granted
and results accepted, `audit` compares them with the trajectories served (lost, duplicated, phantom: all 0).

Used by `simnodes` (each shard keeps a Ledger) and by `bench scale` (the audit after a run). Next step: audit
a node's drop-out mid-rollout too. `delivered` reads what the controller serves, for both.
"""
from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:  # the simulated nodes' processes import this module too
    import httpx

Key = tuple[int, int]  # (prompt, sample): one rollout of the job


class Ledger:
    """What the controller told the simulated nodes: leases granted, results accepted or dropped."""

    def __init__(self) -> None:
        self.leases: dict[str, Key] = {}  # attemptId → (prompt, sample)
        self.accepted: list[Key] = []  # one entry per accepted result (a repeat is a duplicate)
        self.dropped: dict[str, str] = {}

    def leased(self, attempt_id: str, prompt: int, sample: int) -> None:
        self.leases[attempt_id] = (prompt, sample)

    def acked(self, accepted: Iterable[str], dropped: dict[str, str]) -> None:
        for aid in accepted:
            self.accepted.append(self.leases[aid])
        self.dropped.update(dropped)

    def to_json(self) -> dict:
        return {"accepted": self.accepted, "dropped": self.dropped, "leases": len(self.leases)}


@dataclass
class Audit:
    accepted: int
    delivered: int
    lost: list[Key] = field(default_factory=list)  # accepted (or expected) but never delivered
    duplicated: list[Key] = field(default_factory=list)  # accepted or delivered more than once
    phantom: list[Key] = field(default_factory=list)  # delivered, but no node's result was accepted

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.phantom)


def audit(accepted: Iterable[Key], delivered: Iterable[Key], expected: set[Key] | None = None) -> Audit:
    """Compare the results the controller acknowledged with the trajectories it serves. With
    `expected` (a finished job), every expected rollout must also be delivered."""
    acc = collections.Counter(tuple(k) for k in accepted)
    got = collections.Counter(tuple(k) for k in delivered)
    out = Audit(accepted=sum(acc.values()), delivered=sum(got.values()))
    out.duplicated = sorted({k for k, n in acc.items() if n > 1} | {k for k, n in got.items() if n > 1})
    missing = set(acc) - set(got)
    if expected is not None:
        missing |= set(expected) - set(got)
    out.lost = sorted(missing)
    out.phantom = sorted(set(got) - set(acc))
    return out


def delivered(api: httpx.Client, jobs: str, name: str, limit: int = 1000) -> list[Key]:
    """(prompt, sample) of every trajectory job `name` serves (`jobs`: its namespace's rolloutjobs path), in seq
    order, read `limit` at a time."""
    out: list[Key] = []
    cursor = 0
    while True:
        r = api.get(f"{jobs}/{name}/trajectories", params={"cursor": cursor, "limit": limit})
        r.raise_for_status()
        lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
        if not lines:
            return out
        out += [(t["prompt"], t["sample"]) for t in lines]
        cursor = lines[-1]["seq"]
