"""Who this node daemon is and how it talks to the controller: `NodeOptions`, read from the CLI and the environment.

The only place the daemon reads its environment: the launch contract's table (crds/nodeenv.py: controller URL,
job, join token, drain period, Slurm's node identity), read back through `read_node_env`, and the sandbox runtime's
settings (`crds.kit.settings.SandboxSettings`), which the daemon hands to its runtime and task handler.
`daemon.NodeDaemon` takes the options next.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from rolloutd.crds import nodeenv
from rolloutd.crds.errors import FailureKind, RolloutdError
from rolloutd.crds.node import FEATURES
from rolloutd.crds.kit.settings import SandboxSettings, SettingsError

class NodeError(RolloutdError):
    """The daemon cannot go on (bad token, unknown job, unusable spec): exit `EXIT_REFUSED`.
    `config`: the job's spec is at fault (a reason naming the field): reported so the job fails."""

    def __init__(self, message: str, *, config: str | None = None) -> None:
        super().__init__(message)
        self.config = config

    @property
    def kind(self) -> FailureKind:  # type: ignore[override]
        return FailureKind.config if self.config else FailureKind.infra


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
    drain_seconds: float = nodeenv.DEFAULT_DRAIN_SECONDS  # SIGTERM grace period for in-flight rollouts
    controller_start_seconds: float = nodeenv.DEFAULT_CONTROLLER_START_SECONDS  # added to the give-up time
    ca_file: str | None = None           # CA bundle for an https controller (else the system's)
    lease_wait: float = 1.5              # long-poll of one /lease call
    register_timeout: float = 120.0      # keep trying to register this long (controller starting)
    flush_seconds: float = 15.0          # at exit, keep trying to deliver results this long
    result_coalesce: float = 0.005       # results finished this close together go in one batch
    result_batch: int = 64               # results per /results call at most ...
    result_batch_bytes: int = 512 * 1024  # ... and bytes (the controller limits request bodies)
    heartbeat_min_gap: float = 0.05
    retry_max: float = 5.0               # longest back-off between retries to an unreachable controller
    features: tuple[str, ...] = FEATURES  # node-protocol features asked for at registration (crds.node)
    sandbox: SandboxSettings = field(default_factory=SandboxSettings)  # the sandbox runtime's settings
    tracing: bool = False  # ROLLOUTD_TRACING: OpenTelemetry traces (rolloutd.crds.kit.tracing)

    @classmethod
    def from_env(cls, *, controller: str | None = None, job: str | None = None, name: str | None = None,
                 slot: int | None = None, environ: dict[str, str] | None = None) -> "NodeOptions":
        environ = os.environ if environ is None else environ
        try:
            env = nodeenv.read_node_env(environ)
            sandbox = SandboxSettings.from_env(environ)
        except (nodeenv.NodeEnvError, SettingsError) as e:
            raise NodeError(str(e)) from None
        controller = controller or env.controller
        job = job or env.job
        if not controller:
            raise NodeError(f"no controller URL: pass --controller or set {nodeenv.CONTROLLER}")
        if not job:
            raise NodeError(f"no job: pass --job or set {nodeenv.JOB}")
        if not env.join_token:
            raise NodeError(f"no join token: set {nodeenv.JOIN_TOKEN} (never on the command line)")
        if env.ca_file and not os.access(env.ca_file, os.R_OK):
            raise NodeError(f"{nodeenv.CA_FILE}={env.ca_file}: no such readable file")
        return cls(
            controller=controller, job=job, token=env.join_token,
            name=name or env.node_name or socket.gethostname(),
            slot=slot, slurm_job_id=env.slurm_job_id, slurm_node_id=env.slurm_node_id,
            drain_seconds=env.drain_seconds, controller_start_seconds=env.controller_start_seconds,
            ca_file=env.ca_file, sandbox=sandbox, tracing=env.tracing,
        )
