"""A beat's request body and what a beat names: the `Heartbeat` fields the controller knows, finished results
spliced in as the outbox serialized them, and (beat-deltas) the stages changed since the last answered beat.

`heartbeat.Heartbeater` builds every beat with these; the features are those `crds.node.FEATURES` the controller
said it serves at registration (an older controller refuses a field it does not know, so none is sent unasked).
"""
from __future__ import annotations

import json
import math

from rolloutd.crds.node import Heartbeat


def beat_body(hb: Heartbeat, results: list[bytes], *, deltas: bool, turns: bool = False, tokens: bool = False,
              work: bool = False) -> bytes:
    """`hb` as JSON bytes, without `full` unless beat-deltas is served, without `turns` unless beat-turns is, without
    `llmTokens` unless token-share is, without `llmProcessed` and `llmRateHeld` unless work-share is, with
    `results` (each one's wire JSON, already serialized) only when there are some: the controller serves
    beat-results if any are given."""
    leave = {"results"} | (set() if deltas else {"full"}) | (set() if turns else {"turns"})
    leave |= set() if tokens else {"llm_tokens"}
    leave |= set() if work else {"llm_processed", "llm_rate_held"}
    head = json.dumps(hb.wire(exclude=leave), separators=(",", ":")).encode()
    if not results:
        return head
    return head[:-1] + b',"results":[' + b",".join(results) + b"]}"


class ToldStages:
    """What the controller knows of each attempt's stage: the stages of the last answered beats. A beat that
    failed told it nothing, so the next beat's changes are measured from here."""

    def __init__(self) -> None:
        self.stages: dict[str, str] | None = None   # None: nothing told yet, the next beat is full
        self.full_at = -math.inf                    # when the last answered full beat was sent (monotonic)

    def full_due(self, now: float, interval: float) -> bool:
        return self.stages is None or now - self.full_at >= interval

    def changed(self, current: dict[str, str]) -> dict[str, str]:
        """The attempts of `current` whose stage the controller does not know (new ones included)."""
        told = self.stages or {}
        return {aid: stage for aid, stage in current.items() if told.get(aid) != stage}

    def answered(self, current: dict[str, str], *, full: bool, sent_at: float) -> None:
        """A beat built from `current` was answered: the controller now knows every stage in it (a delta beat
        named the ones it did not know, the rest it knew already); attempts gone from `current` are forgotten."""
        self.stages = dict(current)
        if full:
            self.full_at = sent_at
