"""Who this node daemon is and how it talks to the controller: `NodeOptions`, read from the CLI and the environment.

The only place the daemon reads its environment (the launch contract: controller URL, job, join token, drain
period, Slurm's node identity). `daemon.NodeDaemon` takes the options next.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

ENV_CONTROLLER = "ROLLOUTD_CONTROLLER"
ENV_JOB = "ROLLOUTD_JOB"
ENV_TOKEN = "ROLLOUTD_JOIN_TOKEN"
ENV_DRAIN = "ROLLOUTD_DRAIN_SECONDS"
ENV_NODE_NAME = "SLURMD_NODENAME"     # set by Slurm on every node
ENV_SLURM_JOB = "SLURM_JOB_ID"
ENV_SLURM_NODE = "SLURM_NODEID"


class NodeError(Exception):
    """The daemon cannot go on (bad token, unknown job, unusable spec): exit `EXIT_REFUSED`.
    `config`: the job's spec is at fault (a reason naming the field): reported so the job fails."""

    def __init__(self, message: str, *, config: str | None = None) -> None:
        super().__init__(message)
        self.config = config


@dataclass
class NodeOptions:
    """Who this daemon is and how it talks to the controller. `from_env` fills it like the CLI."""

    controller: str
    job: str
    token: str
    name: str
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    slot: int | None = None
    slurm_job_id: str | None = None
    slurm_node_id: int | None = None
    drain_seconds: float = 30.0          # SIGTERM grace period for in-flight rollouts
    lease_wait: float = 1.5              # long-poll of one /lease call
    register_timeout: float = 120.0      # keep trying to register this long (controller starting)
    flush_seconds: float = 15.0          # at exit, keep trying to deliver results this long
    result_coalesce: float = 0.005       # results finished this close together go in one batch
    result_batch: int = 64               # results per /results call at most ...
    result_batch_bytes: int = 512 * 1024  # ... and bytes (the controller limits request bodies)
    heartbeat_min_gap: float = 0.05
    retry_max: float = 5.0               # longest back-off between retries to an unreachable controller

    @classmethod
    def from_env(cls, *, controller: str | None = None, job: str | None = None, name: str | None = None,
                 slot: int | None = None, environ: dict[str, str] | None = None) -> "NodeOptions":
        env = os.environ if environ is None else environ
        controller = controller or env.get(ENV_CONTROLLER)
        job = job or env.get(ENV_JOB)
        token = env.get(ENV_TOKEN)
        if not controller:
            raise NodeError(f"no controller URL: pass --controller or set {ENV_CONTROLLER}")
        if not job:
            raise NodeError(f"no job: pass --job or set {ENV_JOB}")
        if not token:
            raise NodeError(f"no join token: set {ENV_TOKEN} (never on the command line)")
        node_id = env.get(ENV_SLURM_NODE)
        try:
            drain = float(env.get(ENV_DRAIN, "30"))
        except ValueError:
            raise NodeError(f"{ENV_DRAIN} must be a number of seconds, got {env.get(ENV_DRAIN)!r}") from None
        return cls(
            controller=controller, job=job, token=token,
            name=name or env.get(ENV_NODE_NAME) or socket.gethostname(),
            slot=slot, slurm_job_id=env.get(ENV_SLURM_JOB) or None,
            slurm_node_id=int(node_id) if node_id and node_id.isdigit() else None,
            drain_seconds=max(drain, 0.0),
        )
