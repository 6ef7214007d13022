"""verl's checkpoint manager, extended: after verl pushes new weights to its rollout servers, the rolloutd job
follows those servers (their addresses are its backends) and tags later rollouts with verl's global step.

Where it sits: in verl's driver, selected by `actor_rollout_ref.rollout.checkpoint_manager_class`
(verl's own hook); `servers.py` does the talking to rolloutd. Job settings from the environment.
"""
from __future__ import annotations

from typing import Any

from verl.checkpoint_engine import CheckpointEngineManager

from rolloutd.client import RolloutClient
from rolloutd.client.connection import ClientSettings

from .servers import announce_weights, follow_servers


class RolloutdCheckpointManager(CheckpointEngineManager):
    """`update_weights(step)`: verl's weight sync, then `rolloutd_sync(step)`. The job is ROLLOUTD_JOB on
    ROLLOUTD_SERVER (token: ROLLOUTD_TOKEN_FILE), as for the agent loop."""

    def update_weights(self, global_steps: int | None = None) -> Any:
        result = super().update_weights(global_steps)
        self.rolloutd_sync(int(global_steps or 0))
        return result

    def rolloutd_sync(self, version: int) -> dict[str, Any]:
        job = ClientSettings.from_env().job
        if not job:
            raise ValueError("RolloutdCheckpointManager needs ROLLOUTD_JOB (the rolloutd job verl trains from)")
        client = RolloutClient()  # the client's own settings: ROLLOUTD_SERVER, ROLLOUTD_TOKEN_FILE, …
        try:
            backends = follow_servers(client, job, [r.server_address for r in self.replicas])
            return {"backends": backends, "policy": announce_weights(client, job, version)}
        finally:
            client.close()
