"""Fair share of a shared engine's work, in tokens: what each job may keep in flight on each backend it may use.

`attempts.Attempts.beat` calls `beat`: it notes the node's tokens in flight (`Heartbeat.llmTokens`) and puts
`shares(admission, job)` on the reply (`HeartbeatResponse.llmTokens`, feature token-share); the node's
`agents/daemon/tokengate.TokenGate` holds the calls that would exceed it. Admission (`admission.Admission`)
shares a backend's *episodes* by `spec.priority`, but an episode's calls may be whole-context prompts back to back:
the engine's time goes to whoever sends the most tokens. The rule, per backend (a call's cost: its prompt's tokens
plus its `max_tokens`):

- The **budget** is the tokens the engine can hold: `ROLLOUTD_BACKEND_TOKENS` when the operator sets it, else the
  KV cache the engine reports (vLLM's `/server_info`: `cache_config.num_gpu_blocks × block_size`, learned by the
  health probe), else `FALLBACK_TOKENS`; split between node shards like the episode cap.
- A job's **part** is the budget × its weight ÷ the weights of the jobs with episodes there (itself counted).
- **Lending (work-conserving)**: each node's beat reports its tokens in flight plus those of the calls its gate
  holds (its demand; a node silent for `REPORT_SECONDS` stops counting); the backend is **full** when its jobs'
  demands reach the budget. While it is not, a job may go past its part by the room left: its allowance is
  max(part, its demand + room). Once it is full, every job's allowance is its part. So a job is held only when
  the backend is full *and* it is over its part, and what another job leaves unused is lent at once; a job that
  wants more than it may send shows it by the calls its nodes hold, which fills the backend and brings a job
  over its part back to it. (Each job may take the whole room between two beats: the backend may go over its
  budget for a beat, and then every job over its part waits.)
- The reply names **every backend the job may use**: its allowance per episode it has admitted there (each node
  takes its episodes' part), or 0 — no cap — where no other job has episodes. A node waits for a reply only the
  first time it hears of a backend.
"""
from __future__ import annotations

from .admission import Admission

# A backend's tokens in flight when neither the operator nor the engine says: one whole context of a 64k-position
# model. A call larger than a job's allowance still runs, alone, and its job then waits so that its tokens × seconds
# average to it (`agents/daemon/tokengate.py`).
FALLBACK_TOKENS = 65536
REPORT_SECONDS = 30.0  # a node's tokens in flight as its last beat said count about this long (a dead node's lapse)


def budget(admission: Admission, url: str) -> int:
    """The tokens in flight `url`'s jobs share: the operator's, else the engine's KV cache, else the fallback."""
    whole = admission.tokens or admission.reported_tokens.get(url) or FALLBACK_TOKENS
    return max(1, -(-whole // admission.replicas))


def beat(admission: Admission, node: str, job: str, tokens: dict[str, int]) -> dict[str, int]:
    """A beat of `node` said its tokens in flight: note them, and answer the job's allowances."""
    note(admission, node, job, tokens)
    return shares(admission, job)


def note(admission: Admission, node: str, job: str, tokens: dict[str, int]) -> None:
    """`node` (of `job`) has these tokens in flight or held per backend now (its beat's `llmTokens`; empty: none).
    Kept as running sums per backend and job (a beat costs its own backends, not all nodes'); the reports of nodes
    silent for `REPORT_SECONDS` are taken out at most every half of it."""
    now = admission.clock()
    _drop(admission, node)
    # a node speaks for its own job's backends only: a report for another's (another tenant's engine) counts nothing
    allowed = admission.urls_of(job)
    mine = {url: n for url, n in tokens.items() if n > 0 and url in allowed}
    admission.node_tokens[node] = (job, mine, now)
    for url, n in mine.items():
        admission.token_sums[url][job] += n
    if now - admission.tokens_swept >= REPORT_SECONDS / 2:
        admission.tokens_swept = now
        for gone in [k for k, (_, _, at) in list(admission.node_tokens.items()) if at < now - REPORT_SECONDS]:
            _drop(admission, gone)


def _drop(admission: Admission, node: str) -> None:
    old = admission.node_tokens.pop(node, None)
    if old is not None:
        job, tokens, _ = old
        for url, n in tokens.items():
            sums = admission.token_sums[url]
            if job in sums:
                sums[job] -= n
                if sums[job] <= 0:
                    del sums[job]


def in_flight(admission: Admission, url: str) -> dict[str, int]:
    """job → its tokens in flight or held on `url` (its demand), from its nodes' latest reports."""
    return dict(admission.token_sums.get(url, {}))


def shares(admission: Admission, job: str, total: int | None = None) -> dict[str, int]:
    """url → `job`'s tokens in flight allowed per episode it has there, for every backend it may use; 0: no cap
    (no other job has episodes there). `total`: the budget instead of `budget(admission, url)` (tests, bench)."""
    out: dict[str, int] = {}
    urls = set(admission.urls_of(job)) | {u for u, jobs in list(admission.admitted.items()) if jobs.get(job, 0) > 0}
    for url in urls:
        jobs = admission.admitted.get(url, {})
        others = [k for k, n in list(jobs.items()) if n > 0 and k != job]
        if not others:
            out[url] = 0
            continue
        whole = budget(admission, url) if total is None else total
        part = whole * admission.weight(job) // (admission.weight(job) + sum(admission.weight(k) for k in others))
        used = in_flight(admission, url)
        room = whole - sum(used.values())
        allowed = max(part, used.get(job, 0) + room) if room > 0 else part  # full: its part, no more
        out[url] = max(1, allowed // max(1, jobs.get(job, 0)))
    return out
