"""The rolloutd job follows verl's rollout servers: their addresses become the job's LLM backends, and a weight
sync in verl becomes a policy version on the job (later trajectories carry it).

Where it sits: in verl's driver (the process that owns the rollout replicas), called after the replicas start or
restart and after each `checkpoint_manager.update_weights(step)`; `agent_loop.py` is the worker side.
"""
from __future__ import annotations

from typing import Any, Sequence

from rolloutd.client import RolloutClient


def _url(address: str) -> str:
    return address if "://" in address else f"http://{address}"


def follow_servers(client: RolloutClient, job: str, addresses: Sequence[str]) -> list[dict[str, Any]]:
    """Make the job's backends exactly verl's servers (`replica.server_address` of each rollout replica): new
    ones added, gone ones removed. Returns the job's backends afterwards."""
    want = {_url(a) for a in addresses}
    if not want:
        raise ValueError("no rollout server addresses: the job would have no LLM backend")
    have = {b["url"] for b in client.backends(job)}
    for url in sorted(want - have):
        client.add_backend(job, url)
    for url in sorted(have - want):
        client.remove_backend(job, url)
    return client.backends(job)


def announce_weights(client: RolloutClient, job: str, version: int, *, timeout: float | None = 600.0) -> dict[str, Any]:
    """verl has pushed the weights of `version` (its global step) to its own servers: tag later rollouts with it.
    In-flight LLM calls drain first (pause), so no trajectory mixes versions without saying so."""
    return client.announce_policy(job, version, weights_path=None, pause=True, timeout=timeout)
