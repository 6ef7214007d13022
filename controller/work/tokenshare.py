"""Fair share of a shared engine's work, in tokens: each job's allowance of tokens in flight on a backend it shares.

`attempts.Attempts.beat` puts `shares(admission, job)` on every beat's reply (`HeartbeatResponse.llmTokens`,
feature token-share); the node's `agents/daemon/tokengate.TokenGate` holds the calls that would exceed it.
Admission (`admission.Admission`) shares a backend's *episodes* by `spec.priority`, but an episode's calls may be
whole-context prompts back to back: the engine's time goes to whoever sends the most tokens. So when two or more jobs
have episodes admitted on a backend, each gets `BACKEND_TOKENS × its weight / the weights' sum` tokens in flight
there (a call's cost: its prompt's tokens + its `max_tokens`), handed out per admitted episode so that each node
takes the part of its episodes. A job alone on a backend gets no cap (nothing to share: work-conserving).
"""
from __future__ import annotations

from .admission import Admission

# A backend's tokens in flight shared among its jobs: one whole context of a 64k-position model. A call larger
# than a job's share still runs, alone, and its job then waits so that its tokens × seconds average to its share
# (`agents/daemon/tokengate.py`). The operator's `ROLLOUTD_BACKEND_TOKENS` overrides it (`Admission.tokens`).
BACKEND_TOKENS = 65536


def shares(admission: Admission, job: str, budget: int | None = None) -> dict[str, int]:
    """url → `job`'s tokens in flight per admitted episode, on each backend where another job has episodes too."""
    budget = admission.tokens if budget is None else budget
    out: dict[str, int] = {}
    for url, jobs in list(admission.admitted.items()):
        mine = jobs.get(job, 0)
        active = {k: n for k, n in list(jobs.items()) if n > 0}
        if mine <= 0 or len(active) < 2:
            continue
        weights = sum(admission._weight(k) for k in active)
        out[url] = max(1, budget * admission._weight(job) // weights // mine)
    return out
