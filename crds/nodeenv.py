"""The node daemon's environment contract: the one table of variables that launch `rolloutd node`.

Executors build the environment with `node_env` (controller/executors/base.py); the daemon reads it
back with `read_node_env` (agents/daemon/options.py). Secrets travel here, never on a command line.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .errors import ConfigurationError


CONTROLLER = "ROLLOUTD_CONTROLLER"
JOB = "ROLLOUTD_JOB"
JOIN_TOKEN = "ROLLOUTD_JOIN_TOKEN"
DRAIN_SECONDS = "ROLLOUTD_DRAIN_SECONDS"
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_NODE_ID = "SLURM_NODEID"
SLURM_NODE_NAME = "SLURMD_NODENAME"
ADMIN_TOKEN = "ROLLOUTD_TOKEN"
CA_FILE = "ROLLOUTD_CA_FILE"
TRACING = "ROLLOUTD_TRACING"
CONTROLLER_START_SECONDS = "ROLLOUTD_CONTROLLER_START_SECONDS"

DEFAULT_DRAIN_SECONDS = 30.0
# a controller's start does not scale with leaseSeconds: 20 s on a 2-core box at load 22, more above (#37)
DEFAULT_CONTROLLER_START_SECONDS = 60.0

# name → (who sets it, what it means)
TABLE: dict[str, tuple[str, str]] = {
    CONTROLLER: ("executor", "the controller URL the daemon registers with"),
    JOB: ("executor", "the RolloutJob the daemon works for"),
    JOIN_TOKEN: ("executor", "the job's node credential (Bearer): registers nodes for this job only, minted when "
                             "the executor starts the job's daemons and revoked on release"),
    DRAIN_SECONDS: ("operator", f"SIGTERM grace for in-flight rollouts, seconds (default {DEFAULT_DRAIN_SECONDS:g}); "
                                "the Slurm executor reads it too, to time its scancel"),
    SLURM_JOB_ID: ("Slurm", "the allocation the daemon runs in (shrinks drain daemons by it)"),
    SLURM_NODE_ID: ("Slurm", "the daemon's node index within the allocation"),
    SLURM_NODE_NAME: ("Slurm", "the node's name: the daemon's name (else the host name)"),
    CA_FILE: ("executor", "CA bundle that signed an https controller's certificate (default: the system's)"),
    CONTROLLER_START_SECONDS: ("operator", "how long a controller may take to start, seconds (default "
                                           f"{DEFAULT_CONTROLLER_START_SECONDS:g}): a daemon gives its controller "
                                           "up after 20 × spec.pipeline.leaseSeconds plus this without an answer"),
    TRACING: ("operator", "1: export OpenTelemetry traces over OTLP/HTTP (the standard OTEL_* variables say where)"),
    ADMIN_TOKEN: ("never", "the controller's admin API token: removed before a daemon starts"),
}


class NodeEnvError(ConfigurationError, ValueError):
    """A variable of the contract holds a value of the wrong kind (the message names it)."""


@dataclass(frozen=True)
class NodeEnv:
    """The contract's values as the daemon reads them (None: not set)."""

    controller: str | None = None
    job: str | None = None
    join_token: str | None = None
    drain_seconds: float = DEFAULT_DRAIN_SECONDS
    controller_start_seconds: float = DEFAULT_CONTROLLER_START_SECONDS
    slurm_job_id: str | None = None
    slurm_node_id: int | None = None
    node_name: str | None = None
    ca_file: str | None = None
    tracing: bool = False


def node_env(controller: str, job: str, join_token: str) -> dict[str, str]:
    """The variables an executor sets for every daemon it launches (merge over the inherited ones)."""
    return {CONTROLLER: controller, JOB: job, JOIN_TOKEN: join_token}


def seconds(environ: Mapping[str, str], name: str, default: float) -> float:
    """Variable `name` as a non-negative number of seconds; unset or empty is `default`."""
    raw = environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return max(float(raw), 0.0)
    except ValueError:
        raise NodeEnvError(f"{name} must be a number of seconds, got {raw!r}") from None


def drain_seconds(environ: Mapping[str, str]) -> float:
    """`ROLLOUTD_DRAIN_SECONDS` as a non-negative number; unset or empty is the default."""
    return seconds(environ, DRAIN_SECONDS, DEFAULT_DRAIN_SECONDS)


def read_node_env(environ: Mapping[str, str]) -> NodeEnv:
    """The contract read back from a daemon's environment; empty values count as unset."""
    node_id = environ.get(SLURM_NODE_ID, "")
    return NodeEnv(
        controller=environ.get(CONTROLLER) or None,
        job=environ.get(JOB) or None,
        join_token=environ.get(JOIN_TOKEN) or None,
        drain_seconds=drain_seconds(environ),
        controller_start_seconds=seconds(environ, CONTROLLER_START_SECONDS, DEFAULT_CONTROLLER_START_SECONDS),
        slurm_job_id=environ.get(SLURM_JOB_ID) or None,
        slurm_node_id=int(node_id) if node_id.isdigit() else None,
        node_name=environ.get(SLURM_NODE_NAME) or None,
        ca_file=environ.get(CA_FILE) or None,
        tracing=tracing_on(environ.get(TRACING)),
    )


def tracing_on(value: str | None) -> bool:
    """Whether a `ROLLOUTD_TRACING` value turns tracing on (1, true, yes, on)."""
    return (value or "").strip().lower() in ("1", "true", "yes", "on")
