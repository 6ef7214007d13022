"""What an executor is (the `Executor` interface the reconcile calls) and what every executor shares
to launch node daemons: their environment and argv, a crash back-off, an atomic JSON state file.

Implementations: `local.py`, `slurm/executor.py`, `kubernetes/executor.py`, found by kind through the registry
(`executors/__init__.py`), each made from a `Site`. Callers: the kopf handlers (`controller/operator/handlers.py`,
through `operator/reconcile.py`) and the controller's wiring (`server.py`, which also calls `shutdown`). Imports
nothing of the controller.
"""
from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, ClassVar, Literal, Mapping, Protocol, Sequence

from rolloutd.crds.kit.aiokit import backoff_delay
from rolloutd.crds import nodeenv
from rolloutd.crds.errors import FailureKind, RolloutdError
from rolloutd.crds.kit.settings import ControllerSettings
from rolloutd.crds.rolloutjob import RolloutJob


@dataclass
class NodeState:
    """One node daemon as an executor sees it (the reconcile counts the running ones)."""
    name: str
    state: Literal["pending", "running", "lost", "finished"]
    reason: str = ""


class ExecutorError(RolloutdError):
    """Raised by an executor. `permanent` errors (bad partition, invalid spec) fail the job: `config`;
    the others are retried: `infra`."""

    def __init__(self, message: str, *, reason: str = "ExecutorError", permanent: bool = False):
        super().__init__(message)
        self.reason = reason
        self.permanent = permanent

    @property
    def kind(self) -> FailureKind:  # type: ignore[override]
        return FailureKind.config if self.permanent else FailureKind.infra


class Executor(Protocol):
    """Keeps a job's node daemons running. Every call is idempotent (level-triggered). A class registered in the
    `rolloutd.controller.executors` entry-point group also has `from_site(site: Site)`, which makes one."""

    kind: ClassVar[str]  # its name in the registry and in `spec.executor.kind`
    shares_files: bool  # its daemons see this controller's files: a job's tokenizer directory is checked at apply

    async def ensure(self, job: RolloutJob, nodes: int) -> None: ...     # exactly `nodes` daemons, healed
    async def observe(self, job: RolloutJob) -> list[NodeState]: ...     # what runs now
    async def release(self, job: RolloutJob) -> None: ...                # drain, then stop everything
    async def shutdown(self) -> None: ...                                # controller exit: daemons stay

    async def logs(self, job: RolloutJob, node: int | None, tail: int, follow: bool) -> AsyncIterator[str]:
        """The daemons' log lines (all nodes when `node` is None): each source's last `tail` lines, then, with
        `follow`, new ones ("" while quiet) until the caller stops reading; `logs.NoLogs` when there are none."""
        ...


class Credentials(Protocol):
    """The jobs' node credentials (`controller/access/nodeauth.NodeCredentials`): an executor mints the job's when it
    starts the job's daemons and revokes it on release."""

    def mint(self, job: RolloutJob) -> str: ...      # the job's credential (the same one until revoked)
    def revoke(self, job: RolloutJob) -> None: ...   # that job's (not a re-created one's of the same name)


class NodeRoster(Protocol):
    """The registered daemons (`work/node_registry.NodeRegistry`), for executors that drain single nodes."""

    def nodes(self, job: str) -> Sequence[Any]: ...    # rows with id, name, state, slurm_job_id
    def drain(self, job: str, node_ids: list[str]) -> None: ...


class KubeLogin(Protocol):
    """An API server and how to log in to it (`operator/kubeapi.Connection`): operator mode's cluster."""

    server: str
    ca_path: str | None
    insecure: bool

    def bearer(self) -> str | None: ...  # the token to send now (a token file is read again when it changes)


@dataclass(frozen=True)
class Site:
    """What the controller hands each executor it makes (`from_site`): its files, how daemons reach it, the jobs'
    credentials, its settings and the parts an executor may call back into."""
    data_dir: Path                  # the data dir: state files (`StateFile`), daemon logs
    credentials: Credentials
    settings: ControllerSettings    # $ROLLOUTD_DRAIN_SECONDS, $ROLLOUTD_K8S_* ...
    local_url: str                  # how daemons on this host reach the controller (every replica's, this one's first)
    remote_url: Callable[[], str]   # ... and daemons on other hosts (asked when needed: it may look this host up)
    ca_file: Path | None = None     # the CA the daemons trust (the controller serves TLS)
    grace_seconds: float = 30.0     # SIGTERM to SIGKILL for a daemon that ignores its stop
    nodes: NodeRoster | None = None  # the registered daemons (None: a controller without a scheduler)
    event: Callable[[str, str, str, str], None] | None = None  # a job's event: (job, reason, message, type)
    kube: KubeLogin | None = None   # operator mode: the cluster whose RolloutJobs are reconciled


# ---------------------------------------------------------------- daemon launch

def daemon_argv(python: str, *options: str) -> list[str]:
    """The command line of one node daemon: its own module (agents/daemon/__main__.py, `rolloutd node`'s options),
    not the controller's command; never carries a secret."""
    return [python, "-m", "rolloutd.agents.daemon", *options]


def daemon_env(base: Mapping[str, str], extra: Mapping[str, str], controller: str, job: str,
               credential: str) -> dict[str, str]:
    """The daemon's environment: `base` (the controller's, possibly sanitised), `extra`, then the
    contract (crds/nodeenv.py). The admin API token is removed: a daemon needs only its job's credential."""
    env = {**base, **extra, **nodeenv.node_env(controller, job, credential)}
    env.pop(nodeenv.ADMIN_TOKEN, None)
    return env


def crash_count(count: int, started: float | None, now: float, stable_seconds: float, *, reset: int = 1) -> int:
    """Crashes in a row after one more death: `count + 1` when it died within `stable_seconds` of
    starting (or never started), else `reset` (the Slurm executor counts a lone loss as 1, the local
    one as 0)."""
    young = started is None or now - started < stable_seconds
    return count + 1 if young else reset


def crash_delay(count: int, maximum: float, *, free: int = 1) -> float:
    """Before replacing a daemon (or allocation) after `count` crashes in a row: at once for the
    first `free` ones, then 2, 4, 8 … seconds up to `maximum`."""
    return backoff_delay(count, initial=2.0, maximum=maximum, free=free)


def advertised_url(host: str, port: int, scheme: str = "http", url: str | None = None) -> str:
    """The controller URL the daemons on other hosts use: `url` ($ROLLOUTD_ADVERTISE_URL), else this host's
    name when listening on every address, else the address it listens on (`scheme`: https when it serves TLS)."""
    if url:
        return url.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        return f"{scheme}://{socket.getfqdn()}:{port}"
    return f"{scheme}://{host}:{port}"


class StateFile:
    """An executor's record of what it started, in the data dir, so a restarted controller adopts
    it. Written atomically (temporary file + rename): a crash leaves the old or the new record."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> Any:
        """The saved JSON value; None when there is none or it cannot be read."""
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def save(self, data: Any) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(self.path)
