"""The controller's composition root: every part made once (`assemble`), held in one frozen `Root`.

`server.build_app` assembles it and `api.create_app` hands each router exactly the parts it uses; nothing is
written back onto the app, the store or a module global after this. Next step: the operator's parts here too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from prometheus_client import CollectorRegistry, Histogram

from .access.allowlists import AllowLists
from .access.auth import TokenBook
from .executors.base import Executor
from .http.login_limit import LoginLimits
from .http.request_rate import RequestRates
from .http.streams import Streams
from .kube.rolloutjobs import JobParts
from .kube.validate import Checks
from .health.looplag import BUCKETS, LoopLag
from .access.nodeauth import NodeCredentials
from .store.faults import StorageWatch
from .store import Store
from .access.tenancy import Policies
from .work.core import Work, build_work
from .work.scheduler import Scheduler
from .work.stats import JobStats


@dataclass(frozen=True)
class Root:
    """What the controller is made of. `work` and `scheduler` are None for an API without a scheduler (tools,
    tests of the Kubernetes verbs alone); `executors` by kind, the enabled ones."""
    store: Store
    token: str                      # the admin token
    policies: Policies              # the TenantPolicies, cached (`tenancy.py`)
    credentials: NodeCredentials    # the jobs' node credentials (`nodeauth.py`)
    allow: AllowLists               # the controller's allow-lists (`allowlists.py`)
    tokens: TokenBook               # the scoped tokens (`auth.py`)
    streams: Streams                # the scoped tokens' watch slots (`http/streams.py`)
    checks: Checks                  # what a written spec is held to (`kube/validate.py`)
    stats: JobStats                 # the trajectories' running sums: the API's `…/stats` and the web UI
    metrics: CollectorRegistry      # what /metrics serves
    ui_steps: Histogram             # each step of the web UI's live builds on the event loop
    loop_lag: LoopLag               # the event loop's lag probe (run by the server's lifespan)
    storage: StorageWatch           # the store file's disk (`/healthz`, `/readyz`, 503s)
    limits: LoginLimits             # failed token checks and logins per address (the API's and the web UI's)
    rates: RequestRates             # the namespace tokens' API request rates (`http/request_rate.py`)
    work: Work | None
    scheduler: Scheduler | None
    executors: Mapping[str, Executor] = field(default_factory=dict)
    trace_url: str | None = None    # ROLLOUTD_TRACE_URL: the web UI's trace links (`ui/links.py`)

    @property
    def jobs(self) -> JobParts:
        """What the RolloutJob verbs use (`kube/rolloutjobs.py`)."""
        return JobParts(self.store, self.policies, self.checks, self.streams)


def assemble(store: Store, token: str, *, credentials: NodeCredentials | None = None,
             tokens: TokenBook | None = None, allow: AllowLists | None = None, work: dict[str, Any] | None = None,
             executors: Callable[[Work | None], Mapping[str, Executor]] | None = None,
             trace_url: str | None = None) -> Root:
    """`work`: `work.core.build_work`'s settings (None: no scheduler); `executors`: made from the work core (the
    Slurm executor drains single nodes through its registry); `credentials`, `tokens`: in memory, none when omitted;
    `allow`: the defaults when omitted; `trace_url`: the web UI's trace links (none when omitted)."""
    metrics = CollectorRegistry()
    ui_steps = Histogram("rolloutd_ui_step_cpu_seconds", "Each step of the web UI's live builds on the event loop: "
                         "the CPU it held the loop for", buckets=BUCKETS, registry=metrics)
    policies, tokens = Policies(store), tokens or TokenBook(None)
    stats = JobStats(store.engine, observe_step=ui_steps.observe)
    core = None if work is None else build_work(store, policies=policies, stats=stats, **work)
    by_kind = dict(executors(core)) if executors is not None else {}
    allow = allow or AllowLists()
    return Root(store=store, token=token, policies=policies, credentials=credentials or NodeCredentials(None),
                allow=allow, tokens=tokens, streams=Streams(policies, tokens),
                checks=Checks(allow, frozenset(k for k, ex in by_kind.items() if ex.shares_files)),
                stats=stats, metrics=metrics, ui_steps=ui_steps, loop_lag=LoopLag(metrics),
                storage=StorageWatch(store.path), limits=LoginLimits(), rates=RequestRates(policies), work=core,
                scheduler=None if core is None else Scheduler(core),
                executors=by_kind, trace_url=trace_url)
