"""Per-token policy versions from the engine's own weight stamps: the labels (crds/weight_labels.py) the controller
gives a backend's weights at each update, which the engine stamps on every token it generates.

`llmgate.TrackedLLM` calls `stamped_versions` when a call's every request came back stamped (vLLM's token endpoint);
otherwise it keeps the fence's split (`policygate.PolicyGate._fence`).
"""
from __future__ import annotations

from typing import Any

from rolloutd.crds.weight_labels import foreign_version, read_label


def joined(parts: list[tuple[int, list[tuple[str, int, int]] | None]], total: int) -> list[tuple[str, int, int]] | None:
    """The stamps of a call's requests (abort mode resends prompt + tokens so far: a request per part), each given
    with the number of tokens before it, as one list over the call's `total` tokens; None unless they cover each
    token once (a part that made tokens came back without stamps)."""
    out: list[tuple[str, int, int]] = []
    for i, (offset, spans) in enumerate(parts):
        made = (parts[i + 1][0] if i + 1 < len(parts) else total) - offset
        if spans is None and made > 0:
            return None
        out += [(label, offset + start, offset + end) for label, start, end in spans or () if end > start]
    covered = 0
    for _, start, end in out:
        if start != covered:
            return None
        covered = end
    return out if covered == total else None


def stamped_versions(spans: list[tuple[str, int, int]], uid: str, start: Any, now: Any) -> list[tuple[Any, int]]:
    """Run-length versions [(version, tokens)] for stamps [(label, start, end)] over a call's tokens. A label of this
    job's incarnation `uid` names its version. Any other label (the engine's "default", another job's weights on a
    shared backend) is, for the call's first tokens, the version the call started with (`start`: what the gate said
    of the backend, or `now`, what it says at the end, when that names the same foreign weights), and, after the
    weights changed during the call, the other job's `<job>@<version>`."""
    out: list[tuple[Any, int]] = []
    before: str | None = None
    for label, s, e in spans:
        owner = read_label(label)
        if owner is not None and owner[1] == uid:
            version = owner[2]
        elif before is None:
            foreign = foreign_version(owner[0], owner[2]) if owner is not None else None
            version = now if foreign is not None and now == foreign else start
        elif label == before:
            version = out[-1][0]
        else:
            version = foreign_version(owner[0], owner[2]) if owner is not None else label
        before = label
        if out and out[-1][0] == version:
            out[-1] = (version, out[-1][1] + e - s)
        else:
            out.append((version, e - s))
    return out
