"""What the harness gateway records: each LLM call exactly as the engine saw and produced it (`Call`), the
calls stitched into token sequences (`stitch` → `Segment`), and the prompt ids of rendered chat text
(`PieceEncoder`, each stretch between added tokens encoded once per rollout).

Used by agents/gateway/server.py (records), agents/tasks/harness.py (stitches). Next step: the segments become the
trajectory's sequences.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    """One LLM call the harness made, exactly as the engine saw and produced it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_reason: Any = None  # the engine's: the stop string or token id that ended it, if any
    versions: list[tuple[Any, int]] = field(default_factory=list)  # (policy version, tokens) runs: the node's gate


@dataclass
class Segment:
    """A run of calls each extending the sequence's tokens: one token sequence with its loss mask."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    prompt_length: int = 0
    calls: int = 0
    drift: bool = False  # started because a re-tokenized history no longer matched the recorded ids
    turns: list[tuple[int, int, str]] = field(default_factory=list)  # each call's generated [start, end), finish
    retokenized: int = 0  # prompt ids past the longest prefix shared with an earlier sequence (sent again as text)
    versions: list[tuple[Any, int, int]] = field(default_factory=list)  # (policy version, start, end) of generated ids


def _shared(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def stitch(calls: list[Call], decode=None) -> list[Segment]:
    """Calls → as few sequences as the ids allow. PREFIX MERGE: a call whose prompt starts with the tokens
    of any sequence so far (the longest such) continues it, new prompt tokens with mask 0 and the generated
    ones with mask 1; a harness that made a side call (a title, a summary) and went back to its history
    lands in its old sequence. Any other call starts a new sequence, whose prompt ids past the longest prefix
    shared with an earlier sequence count as `retokenized` (the harness sent that history again as text, or
    rewrote it). With `decode`, a new sequence whose text still starts with the closest one's is marked
    `drift` (the harness kept the history, the tokens changed) rather than a rewrite (compacted, truncated)."""
    segments: list[Segment] = []
    for call in calls:
        prompt = call.prompt_ids
        fits = [s for s in segments if prompt[: len(s.token_ids)] == s.token_ids]
        cur = max(fits, key=lambda s: len(s.token_ids), default=None)
        if cur is not None:
            extra = prompt[len(cur.token_ids):]
        else:
            shared, near = max(((_shared(prompt, s.token_ids), s) for s in segments),
                               key=lambda x: x[0], default=(0, None))
            drift = bool(near is not None and decode is not None and decode(prompt).startswith(decode(near.token_ids)))
            cur = Segment(prompt_length=len(prompt), drift=drift, retokenized=len(prompt) - shared if near else 0)
            segments.append(cur)
            extra = prompt
        cur.token_ids += extra
        cur.loss_mask += [0] * len(extra)
        cur.logprobs += [None] * len(extra)
        if call.token_ids:
            cur.turns.append((len(cur.token_ids), len(cur.token_ids) + len(call.token_ids), call.finish_reason))
        at = len(cur.token_ids)
        for version, n in call.versions:  # the node's gate: which version generated which of the call's ids
            cur.versions.append((version, at, at + n))
            at += n
        cur.token_ids += call.token_ids
        cur.loss_mask += [1] * len(call.token_ids)
        cur.logprobs += list(call.logprobs)
        cur.calls += 1
    return segments


class PieceEncoder:
    """Ids of rendered chat text, each stretch between the tokenizer's added tokens (`<|im_end|>`...) encoded
    once per rollout: a harness re-sends its whole history every call, and the tokenizer splits on added
    tokens before anything else, so the stretches are independent and the ids those of one `encode_text`.
    Used only where that holds (no strip/normalized added tokens, checked on a probe); else `encode_text`."""

    LIMIT = 4096  # stretches kept per rollout

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}
        self._split: re.Pattern | None = None
        backend = getattr(getattr(tokenizer, "hf", None), "_tokenizer", None)
        try:
            added = backend.get_added_tokens_decoder()
        except AttributeError:
            return
        if not added or any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in added.values()):
            return
        self._backend, self._ids = backend, {t.content: i for i, t in added.items()}
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(self._ids, key=len, reverse=True))) + ")")
        special = sorted(self._ids)
        probe = f"{special[0]} Hé llo\n  {special[-1]}\n\tx{special[0]}{special[-1]}y  "
        if self.encode(probe) != tokenizer.encode_text(probe):  # e.g. a prefix space only at the text's start
            self._split = None
        self._cache.clear()

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.tokenizer.encode_text(text)
        out: list[int] = []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self._ids[piece])
            elif piece:
                ids = self._cache.get(piece)
                if ids is None:
                    ids = self.tokenizer.encode_text(piece)
                    if len(self._cache) < self.LIMIT:
                        self._cache[piece] = ids
                out += ids
        return out


__all__ = ["Call", "PieceEncoder", "Segment", "stitch"]
