"""Wire models of the node-daemon protocol (controller ⇄ `rolloutd node`).

The daemon (`rolloutd.agents.daemon`) *pulls* work; the controller (`rolloutd.controller.http.node_protocol`
+ `controller/work/`) owns every decision. All calls are POSTs under
`/apis/rolloutd.io/v1alpha1/nodes` (or the job's namespaced `…/rolloutjobs/{name}/nodes`): register with the
job's node credential, every other call with the node's own token (feature node-token) as `Authorization: Bearer`:

    POST /nodes/register                 RegisterRequest  → RegisterResponse  (`?features=…`: see FEATURES)
    POST /nodes/{node}/lease             LeaseRequest     → LeaseResponse     (long-poll up to `wait` s)
    POST /nodes/{node}/heartbeat         Heartbeat        → HeartbeatResponse (a full beat renews the leases it
                                                                           names; may carry results: FEATURES)
    POST /nodes/{node}/results           ResultBatch      → ResultAck
         (both take `?lease=N`: the next leases ride on the reply, see LEASE_PARAM)
    POST /nodes/{node}/return            ReturnRequest    → {}                (unstarted leases handed back)
    POST /nodes/{node}/policy-watch      PolicyWatch      → PolicyState       (long-poll: feature policy-watch)
    POST /nodes/{node}/deregister        {}               → {}

Exactly-once delivery rests on `attemptId`: a result is accepted only from the attempt that
currently holds the item's lease; a late duplicate from an expired attempt is dropped.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from .base import Model
from .tenancy import TenantPolicySpec
from .trajectory import PolicyVersion, Trajectory

# A node's counts and seconds, bounded: a hostile beat's 10**400 would overflow the controller's float arithmetic on
# them (a 500 on every beat of every job sharing that backend), and NaN would poison the namespace's counters
Count = Annotated[int, Field(ge=0, le=2 ** 53)]
Seconds = Annotated[float, Field(ge=0.0, le=2.0 ** 53, allow_inf_nan=False)]
# A register's numbers are stored in 32-bit columns on PostgreSQL: a bigger one was a 500 at every retry there
Int32 = Annotated[int, Field(ge=0, le=2 ** 31 - 1)]

Stage = Literal["leased", "init", "run", "eval"]

# Attempts one call may name (a lease's items, a beat's stages, turns or results, a results call, a return): far more
# than a node runs at once (each pool's workers are at most MAX_WORKERS), few enough for one query to name them all.
# Unbounded, a list past PostgreSQL's 65 535 parameters per statement was answered 503 at every retry of that call.
MAX_ATTEMPTS_PER_CALL = 2 ** 14
# A beat's per-backend maps (url → count): a job's backends, with room to spare
MAX_BACKENDS_PER_CALL = 1024


# The node protocol's version, which a daemon sends at registration. A change of the messages is negotiated, not
# bumped: a field a peer may not know is sent only to a daemon that declared the feature it belongs to (FEATURES),
# so a controller serves every daemon from MIN_NODE_PROTOCOL on with the features that daemon declared. 2: a
# trajectory's turns carry their times (`Turn.started`, `modelSeconds`, `toolSeconds`), which a controller of 1
# refuses (422), so it refuses a daemon of 2 up front, with a message that says so.
NODE_PROTOCOL = 2
MIN_NODE_PROTOCOL = 1


# The timed beats (not the paced ones) all a job's daemons send together, about: `heartbeat_seconds` grows the
# interval past 100 nodes to keep to it.
TIMED_BEATS_PER_SECOND = 200.0


def heartbeat_seconds(nodes: int, lease_seconds: float) -> float:
    """The beat interval the controller gives each of a job's `nodes` daemons at registration: 0.5 s up
    to 100 nodes, then growing with the count so that together they send about `TIMED_BEATS_PER_SECOND`,
    at most a sixth of the lease (a lease outlives several missed beats)."""
    return min(max(0.5, nodes / TIMED_BEATS_PER_SECOND), lease_seconds / 6)


def heartbeat_min_gap(interval: float) -> float:
    """Beats prompted by stage changes come at most this often (a burst of changes is one beat): a
    fifth of the interval, at least 50 ms, so the gap grows with the cluster as the interval does
    (measured: docs/content/benchmarks.md, `scale`)."""
    return max(0.05, interval / 5)


def result_coalesce(interval: float) -> float:
    """How long a daemon gathers finished results into one call, from its beat interval (which grows with the
    cluster, see `heartbeat_seconds`): 5 ms for a small cluster, at most a quarter second, so a big cluster
    sends fewer, fuller calls while a rollout's result waits a quarter second at most."""
    return min(0.25, max(0.005, (interval - 0.5) / 18))


# A daemon's connection to the controller stays open between beats, which may be seconds apart on a big cluster
# (`beat_gap`): longer than any beat gap, and the daemon's shorter than the controller's, so the daemon closes an
# idle connection first (a request sent as the server closes it would fail).
DAEMON_KEEP_ALIVE_SECONDS = 60.0
CONTROLLER_KEEP_ALIVE_SECONDS = 75.0
# An engine's server (vLLM: VLLM_HTTP_TIMEOUT_KEEP_ALIVE, uvicorn's 5 s) closes an idle connection after 5 s: every
# client of an engine closes its own first, else a call sent just as the engine closes fails ("Server disconnected")
ENGINE_CLIENT_KEEP_ALIVE_SECONDS = 4.0
# A daemon given several controller addresses bounds each call by this (a paused leader accepts connections and
# answers nothing), then moves to the next address; a new leader gives every lease it adopts this much more.
FAILOVER_CALL_SECONDS = 10.0
# on the reply of a node call one replica forwarded to another (node shards on PostgreSQL, controller/ha/shards.py): the
# replica that owns the node; the daemon calls it from then on (feature owner-redirect: a 421 naming it, unforwarded)
OWNER_HEADER = "x-rolloutd-owner"
MISDIRECTED = 421  # feature owner-redirect: a node call that reached a replica not owning the node, not processed
# on a node call a daemon sends back to the replica whose 421 named an owner that gave no answer (a killed replica):
# that owner's URL; the replica takes the node over at once (controller/ha/shards.py, `Shards.take_over`)
UNREACHABLE_HEADER = "x-rolloutd-unreachable"


# Features a daemon may ask for at registration (`POST …/register?features=a,b`); the controller answers with
# those it serves in `RegisterResponse.features` (absent: an older controller, which ignores the parameter, or a
# daemon that did not ask), so neither side meets a field it does not know, as with LEASE_PARAM.
#   beat-results  a beat carries the node's finished results (`Heartbeat.results`) and its reply acknowledges
#                 them (`HeartbeatResponse.accepted`/`dropped`): one call per beat instead of a beat and a
#                 results call; beats come at most every `HeartbeatResponse.beatGap` s (the controller's pacing)
#   beat-deltas   a beat prompted by a change names only what changed since the last answered beat
#                 (`Heartbeat.full` false); the timed beats, every `heartbeatSeconds`, name every live lease
#                 and are the ones that renew leases
#   node-token    the reply carries the node's own token (`RegisterResponse.nodeToken`): its per-node calls
#                 (lease, heartbeat, results, return, deregister) send it instead of the job's credential, which
#                 only registers. A job credential must ask for it (a node acts only as itself)
#   beat-turns    a beat names the turn of each rollout in RUN (`Heartbeat.turns`: the model calls it started), for
#                 the in-flight view (`controller/work/inflight.py`)
#   lease-trace   a lease carries the attempt's W3C trace context (`Lease.traceparent`, tracing on)
#   beat-fence    a beat's reply carries the keep-mode fence and the backends behind the job's version
#                 (`HeartbeatResponse.llmFence`, `backendVersions`); a daemon without it takes no fence (the
#                 controller's wait for it ends at its timeout) and is told nothing of lagging backends
#   policy-watch  `POST …/{node}/policy-watch` long-polls the job's policy (`PolicyWatch` → `PolicyState`): the
#                 controller answers as soon as it changes (an update's hold, fence, new version), so an update reaches
#                 the daemon in one round trip, not at its next beat; the same call (wait 0) reports what a beat
#                 would (calls in flight, held, fence taken) the moment it changes. A daemon without it learns and
#                 reports by beats, as before
#   weight-stamps the controller labels every backend at every update it makes (crds/weight_labels.py, vLLM's
#                 `/update_weight_version` while the engine is paused) and the registration's reply carries the job's
#                 incarnation (`RegisterResponse.jobUid`), so a daemon whose backend stamps each token with its
#                 weights' label (vLLM's token endpoint) reads each token's version from the engine and takes a
#                 keep-mode fence at once for those streams (others are aborted and continued, as in abort mode)
#   token-share   a beat carries the node's tokens in flight or held per backend (`Heartbeat.llmTokens`), its reply the
#                 job's allowance on every backend it may use, in tokens in flight per admitted episode, 0 where it
#                 has no cap (`HeartbeatResponse.llmTokens`, `controller/work/tokenshare.py`); the daemon holds calls
#                 that would exceed it, and waits for a reply only for a backend no reply named yet
#                 (`agents/daemon/tokengate.py`). A daemon without it is never held
#   work-share    a beat carries the tokens the node's model calls processed per backend, ever (`Heartbeat.llmProcessed`:
#                 prompt tokens the engine did not have cached + tokens generated) and its holds (`llmRateHeld`), its
#                 reply the job's processed tokens per second allowed per admitted episode on every backend it may use,
#                 0 where it has no limit (`HeartbeatResponse.llmRates`, `controller/work/workshare.py`); the daemon
#                 holds a call before sending it while its job is over it (`agents/daemon/rategate.py`)
#   owner-redirect a node call that reaches a controller replica not owning the node (node shards) is answered at once
#                 421 Misdirected Request naming the owner (OWNER_HEADER), not forwarded: nothing of it was processed,
#                 so the daemon re-sends it to the owner at once and calls the owner from then on; an owner that gives
#                 no answer: the call goes back to the replica that named it, with UNREACHABLE_HEADER, which takes the
#                 node over and answers it. A daemon without it has its calls forwarded (twice the hops, and the
#                 replica's CPU on each)
# A daemon that declared none (an older one) gets none of these fields: `REPLY_FIELDS` names them per feature.
FEATURES_PARAM = "features"
BEAT_RESULTS, BEAT_DELTAS, NODE_TOKEN, BEAT_TURNS = "beat-results", "beat-deltas", "node-token", "beat-turns"
LEASE_TRACE, BEAT_FENCE, POLICY_WATCH = "lease-trace", "beat-fence", "policy-watch"
WEIGHT_STAMPS, TOKEN_SHARE, WORK_SHARE = "weight-stamps", "token-share", "work-share"
OWNER_REDIRECT = "owner-redirect"
FEATURES = (BEAT_RESULTS, BEAT_DELTAS, NODE_TOKEN, BEAT_TURNS, LEASE_TRACE, BEAT_FENCE, POLICY_WATCH, WEIGHT_STAMPS,
            TOKEN_SHARE, WORK_SHARE, OWNER_REDIRECT)
# work-share: the controller sums each job's processed tokens over this window, and debt from several calls is at most
# this many seconds of a node's allowance (longer than what is measured would be a guess; shorter: the benchmarks
# page, Constants)
WORK_WINDOW_SECONDS = 60.0
POLICY_WATCH_SECONDS = 25.0  # a watch's long-poll (under the daemon's call timeout and any proxy's idle cut)
# reply fields sent only to a daemon that declared their feature: (model name, field) per feature
REPLY_FIELDS = {LEASE_TRACE: (("Lease", "traceparent"),),
                BEAT_FENCE: (("HeartbeatResponse", "llm_fence"), ("HeartbeatResponse", "backend_versions")),
                TOKEN_SHARE: (("HeartbeatResponse", "llm_tokens"),), WORK_SHARE: (("HeartbeatResponse", "llm_rates"),)}

# The controller paces daemons that send results on beats: together they send about this many beats a second
# (`ROLLOUTD_NODE_CALLS_PER_SECOND`), so each beats every (active nodes ÷ budget) s on average. The budget keeps
# the controller's event loop about two thirds busy with node calls, where calls barely queue; the measurements
# behind it are the `scale` rows of docs/content/benchmarks.md (bench/results/RESULTS-scale.md).
NODE_CALLS_PER_SECOND = 250.0
MIN_BEAT_GAP = 0.005


def beat_gap(active_nodes: int, calls_per_second: float = NODE_CALLS_PER_SECOND) -> float:
    """The mean gap between two beats of one daemon when `active_nodes` daemons share the budget (each waits
    `spaced_gap` of it)."""
    return max(MIN_BEAT_GAP, active_nodes / max(calls_per_second, 1.0))


def spaced_gap(gap: float, u: float) -> float:
    """A daemon's wait between two paced beats, `u` uniform in [0, 1): between ½ and 1½ `gap`, `gap` on average.
    Daemons answered by one group commit would otherwise all come back at once, `gap` later, again and again
    (the benchmarks page, Constants)."""
    return gap * (0.5 + u)


# A node's name is its id's start (`{name}-{8 hex}`), which goes in a URL's path: letters, digits and ._:@+- only
# (a '/', '?', '%' or a control character would make a path the node cannot call). Free text it sends has no control
# character; a NUL elsewhere is stored (`controller.store.nul_text`).
NODE_NAME = r"^[A-Za-z0-9_][A-Za-z0-9._:@+-]{0,199}$"
PRINTABLE = r"^[^\x00-\x1f\x7f]*$"


class RegisterRequest(Model):
    job: str
    protocol: int | None = Field(default=None, description="NODE_PROTOCOL of the daemon (None: a daemon from "
                                                           "before the check)")
    name: str = Field(pattern=NODE_NAME, description="host or Slurm node name: the node's id, which its calls' URLs "
                                                      "carry, starts with it")
    host: str = Field(default="", max_length=253, pattern=PRINTABLE)
    pid: Int32 = 0
    slurm_job_id: str | None = Field(default=None, max_length=64, pattern=PRINTABLE)
    slurm_node_id: Int32 | None = None
    slot: Int32 | None = Field(default=None, description="executor slot this daemon fills (local executor)")


class RegisterResponse(Model):
    node_id: str
    job: str
    spec: dict[str, Any] = Field(description="the RolloutJob spec (wire form) at registration time")
    generation: int
    lease_seconds: float
    heartbeat_seconds: float
    features: list[str] | None = Field(default=None, description="the asked FEATURES this controller serves "
                                                                  "(absent: none asked)")
    node_token: str | None = Field(default=None, description="the node's own bearer token for its per-node calls "
                                                             "(feature node-token; absent: not asked)")
    policy: TenantPolicySpec | None = Field(default=None, description="the TenantPolicy the job is held to, as "
                                            "stored at registration (absent: unrestricted, the admin's job); the node "
                                            "checks the spec against it again before it starts a sandbox")
    policy_name: str | None = Field(default=None, description="how a refusal names it: 'TenantPolicy team-a' or "
                                                             "'the restricted profile'")
    job_uid: str | None = Field(default=None, description="the job's uid, which the weight labels carry (feature "
                                                         "weight-stamps; absent: not asked)")


class LeaseRequest(Model):
    max_items: int = Field(ge=0, le=MAX_ATTEMPTS_PER_CALL)
    wait: float = Field(default=0.0, ge=0.0, le=30.0, description="long-poll this long for work")


class Lease(Model):
    attempt_id: str
    item: int
    prompt: int
    sample: int
    attempt: int
    task: dict[str, Any]
    backend: str | None = Field(description="the LLM backend URL pinned to this task")
    policy_version: int | str | None = None
    queued_seconds: float = 0.0
    traceparent: str | None = Field(default=None, max_length=128,
                                    description="W3C trace context of the attempt's trace (tracing on)")


class LeaseResponse(Model):
    leases: list[Lease] = Field(default_factory=list)
    done: bool = Field(default=False, description="the job needs no more work from this daemon")
    drain: bool = Field(default=False, description="stop leasing (scale-down or job ending)")


# A lease may ride on a beat's or a results call's reply: the daemon adds `?lease=N` (its free slots) and the
# reply's `lease` field answers it as `POST …/lease` with `wait` 0 would. A controller that does not know the
# parameter ignores it and answers without the field (the daemon then leases by its own calls), and the field
# is only sent to a daemon that asked, so neither side meets a field it does not know.
LEASE_PARAM = "lease"


class Result(Model):
    attempt_id: str
    trajectory: Trajectory


class Heartbeat(Model):
    stages: dict[str, Stage] = Field(default_factory=dict, max_length=MAX_ATTEMPTS_PER_CALL,
                                     description="attemptId → stage of every live lease")
    left_run: list[str] = Field(default_factory=list, max_length=MAX_ATTEMPTS_PER_CALL,
                                description="attempts whose RUN ended since the last beat")
    llm_inflight: int = Field(default=0, description="LLM requests this node has in flight right now")
    llm_held: bool = Field(default=False, description="this node holds new LLM requests (it saw llmPaused)")
    policy_version: PolicyVersion | None = Field(default=None, description="the version this node tags new requests "
                                                                           "with")
    llm_fence: int = Field(default=0, description="keep mode: the last fence this node took (it recorded where each "
                                                  "in-flight generation stood while the engines were paused)")
    full: bool = Field(default=True, description="`stages` names every live lease, and the beat renews them; false "
                                                 "(beat-deltas): only the stages changed since the last answered beat")
    results: list[Result] = Field(default_factory=list, max_length=MAX_ATTEMPTS_PER_CALL, description=(
        "finished results (beat-results), applied as POST …/results applies them"))
    turns: dict[str, int] = Field(default_factory=dict, max_length=MAX_ATTEMPTS_PER_CALL, description=(
        "beat-turns: attemptId → the turn of a rollout in RUN (the model calls it started)"))
    llm_tokens: dict[str, Count] = Field(default_factory=dict, max_length=MAX_BACKENDS_PER_CALL, description=(
        "token-share: url → the tokens of this node's model calls in flight or held at its gate (prompt + max_tokens "
        "of each)"))
    llm_processed: dict[str, Count] = Field(default_factory=dict, max_length=MAX_BACKENDS_PER_CALL, description=(
        "work-share: url → the tokens this node's model calls processed there, ever (prompt tokens not cached + "
        "tokens generated)"))
    llm_rate_held: list[Seconds] = Field(default_factory=list, max_length=2, description="work-share: [model calls held "
                                       "for the job's work share, seconds they waited], both ever")


class HeartbeatResponse(Model):
    cancel: list[str] = Field(default_factory=list, description="attempts to cancel now (kill sandbox, abort LLM)")
    repin: dict[str, str] = Field(default_factory=dict, description="attemptId → new backend (its backend was removed)")
    unknown: list[str] = Field(default_factory=list, description="attempts the controller no longer leases to you")
    drain: bool = False
    lease_seconds: float = 30.0
    policy_version: int | str | None = None
    llm_paused: bool = Field(default=False, description="hold new LLM requests (weights are being updated)")
    llm_fence: int = Field(default=0, description="keep mode: the engines are paused with their requests in place; "
                                                  "record where each in-flight generation stands, then say so")
    backend_versions: dict[str, int | str | None] = Field(default_factory=dict, description=(
        "backends that failed to load the current version: url → the version they still run"))
    llm_tokens: dict[str, int] = Field(default_factory=dict, description=(
        "token-share: url → the job's tokens in flight allowed per episode it has admitted there, for every backend "
        "the job may use; 0: no cap (no other job has episodes there)"))
    llm_rates: dict[str, float] = Field(default_factory=dict, description=(
        "work-share: url → the job's processed tokens per second allowed per episode it has admitted there, for every "
        "backend the job may use; 0: no limit"))
    lease: LeaseResponse | None = Field(default=None, description="the leases `?lease=N` asked for (absent: not asked)")
    # beat-results only (absent for a daemon that did not register with the feature):
    accepted: list[str] | None = Field(default=None, description="the beat's results accepted")
    dropped: dict[str, str] | None = Field(default=None, description="attemptId → why the beat's result was not accepted")
    beat_gap: float | None = Field(default=None, description="beat at most this often (s): the controller's pacing")


class PolicyWatch(Model):
    """A daemon's policy watch (feature policy-watch): what it knows of the job's policy (`epoch` of `instance`,
    from the last `PolicyState` it applied) and its report, as a beat's LLM fields carry it."""
    instance: str = Field(default="", max_length=64, description="the controller process the epoch counts in")
    epoch: int = Field(default=-1, description="the policy epoch the daemon applied last (-1: none)")
    wait: float = Field(default=0.0, ge=0.0, le=30.0, description="long-poll this long for a change")
    seq: int = Field(default=0, description="counts the daemon's watches: a report older than one seen is not noted")
    llm_inflight: int = 0
    llm_held: bool = False
    llm_fence: int = 0


class PolicyState(Model):
    """The job's policy as a beat's reply gives it, with the epoch it was read at: a daemon applies a state only if
    it is newer than the one it has (two watches may be answered out of order)."""
    instance: str
    epoch: int
    policy_version: int | str | None = None
    llm_paused: bool = False
    llm_fence: int = 0
    backend_versions: dict[str, int | str | None] = Field(default_factory=dict)


class ResultBatch(Model):
    results: list[Result] = Field(max_length=MAX_ATTEMPTS_PER_CALL)


class ResultAck(Model):
    accepted: list[str] = Field(default_factory=list)
    dropped: dict[str, str] = Field(default_factory=dict, description="attemptId → why it was not accepted")
    lease: LeaseResponse | None = Field(default=None, description="the leases `?lease=N` asked for (absent: not asked)")


class ReturnRequest(Model):
    attempt_ids: list[str] = Field(max_length=MAX_ATTEMPTS_PER_CALL)
    reason: str = Field(default="returned", max_length=1000, description="why (the items' last error)")
