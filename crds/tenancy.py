"""The TenantPolicy resource: what one namespace's jobs may ask of the cluster, set by the admin.

The analogue of Pod Security Admission, PersistentVolumes, ResourceQuota and NetworkPolicy for rolloutd.
One policy per namespace (cluster-scoped, `metadata.name` is the namespace it governs); a namespace without
one gets `RESTRICTED`. The controller checks a job against it at apply (`violations`, a 422 naming the field
and the policy) and sends it to the job's node daemons, which check again before they start a sandbox.
A job last written with the admin token is `unrestricted` (None): the admin keeps every power.
"""
from __future__ import annotations

import fnmatch
import posixpath
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator

from .base import Model
from .names import GROUP, VERSION
from .rolloutjob import RuntimeKind

if TYPE_CHECKING:
    from .rolloutjob import RolloutJobSpec

POLICY_KIND = "TenantPolicy"
POLICY_PLURAL = "tenantpolicies"
RESTRICTED_NAME = "restricted"  # how a namespace without a policy of its own names its profile
# Set by the controller on every write of a job: "admin", or the scoped token's name. Never taken from a client.
ADMITTED_BY = f"{GROUP}/admitted-by"
# sandbox.env names no policy can allow: they steer the dynamic loader or rolloutd's own processes
NEVER_ENV = ("LD_*", "ROLLOUTD_*")


def _absolute(path: str) -> str:
    if not path.startswith("/") or "\0" in path or ".." in path.split("/"):
        raise ValueError(f"must be an absolute path without '..': {path!r}")
    return posixpath.normpath(path)


def beneath(path: str, root: str) -> bool:
    """`path` is `root` or lies below it (both normalised absolute paths; no link is resolved here)."""
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root + "/") or root == "/"


class VolumeGrant(Model):
    """A host path the admin lets this namespace's jobs mount (`spec.sandbox.mounts`), or anything below it."""

    host_path: str = Field(description="absolute host path; a job may mount it or a directory below it")
    read_only: bool = Field(default=True, description="false: jobs may mount it writable (readOnly: false)")

    _abs = field_validator("host_path")(classmethod(lambda cls, v: _absolute(v)))


class TenantQuotas(Model):
    """Bounds on what a namespace holds at once."""

    jobs: int = Field(default=16, ge=0, le=100_000, description="RolloutJobs stored in the namespace")
    items_per_job: int = Field(default=100_000, ge=1, description="rollouts (prompts × samplesPerPrompt) one job "
                               "opens over its life: its expansion stops and the job fails with QuotaExceeded past it; "
                               "a batch or DAPO job's batch request past it is refused (403)")
    nodes: int = Field(default=2, ge=0, le=4096, description="node daemons of all the namespace's jobs together "
                       "(the sum of executor.nodes)")
    sandboxes_per_node: int = Field(default=64, ge=1, description="sandboxes one node daemon may hold at once "
                                    "(pipeline.workersPerNode init + run + eval, plus sandbox.warm)")
    watches: int = Field(default=16, ge=0, description="open watches by the namespace's tokens (more: 429)")
    sandbox_cpus: float = Field(default=2.0, gt=0, description="the most sandbox.limits.cpus a job may ask for (a "
                                "job may not turn the bound off); a step of its image builds gets at most this too")
    sandbox_memory_mb: int = Field(default=8192, ge=16, alias="sandboxMemoryMB", description="the most "
                                   "sandbox.limits.memoryMB a job may ask for; a step of its image builds gets at most "
                                   "this too")
    workspace_mb: int = Field(default=8192, ge=1, alias="workspaceMB", description="the most "
                              "sandbox.limits.workspaceMB a job may ask for (a job may not turn the bound off)")
    sandbox_processes: int = Field(default=1024, ge=8, description="the most sandbox.limits.processes a job may "
                                   "ask for; a step of its image builds gets at most this too")
    tmp_mb: int = Field(default=4096, ge=1, alias="tmpMB", description="the most sandbox.limits.tmpMB a job may ask "
                        "for (tmpfs counts against the node's memory)")
    wall_seconds: int = Field(default=3600, ge=1, description="the most sandbox.limits.wallSeconds a job may ask for")
    stage_seconds: float = Field(default=3600.0, gt=0, description="the most any of timeouts.initSeconds, "
                                 "runSeconds, evalSeconds and actionSeconds may be, and a step and a whole image build "
                                 "of its jobs")
    max_total_tokens: int | None = Field(default=None, ge=1, description="the most agent.sampling.maxTotalTokens "
                                         "a job may ask for, and so the longest prompt one of its engine calls sends "
                                         "(null: no cap, the engine's context bounds it). An engine prefills a prompt "
                                         "in one step, and every other job's calls on that engine wait through it: on "
                                         "engines namespaces share, a cap bounds that wait")
    priority: int = Field(default=10, ge=1, le=1000, description="the largest spec.priority (a job's fair-share "
                          "weight on the backends it shares) a job may set")
    requests_per_second: float = Field(default=50.0, gt=0, le=10_000, description="API requests per second each of "
                                     "the namespace's tokens may make, sustained (a token bucket per token; a "
                                     "request over it waits its turn, and is answered 429 with Retry-After when 8 of "
                                     "that token's requests are already waiting; a watch or follow counts once, when "
                                     "it opens)")
    request_burst: int = Field(default=100, ge=1, le=100_000, description="API requests each of the namespace's "
                               "tokens may make at once before requestsPerSecond holds it")


class TenantPolicySpec(Model):
    """What a namespace's jobs may use. The defaults are the restricted profile."""

    runtimes: list[RuntimeKind] = Field(
        default_factory=lambda: ["bwrap"], description="sandbox.runtime values allowed (process runs tool calls on "
        "the host as the daemon's user: give it to no tenant you do not trust with the node)")
    images: list[str] = Field(default_factory=lambda: ["host"], description="sandbox.image values allowed: 'host', "
                              "or absolute paths (a rootfs directory or .sif file, or a directory holding them). "
                              "Images a harbor task builds from its own Dockerfile are always allowed")
    volumes: list[VolumeGrant] = Field(default_factory=list, description="host paths sandbox.mounts may name")
    users: list[str] = Field(default_factory=list, description="sandbox.user values allowed with image: host (host "
                             "users); a user of a rootfs image is the image's own and needs no grant")
    env: list[str] = Field(default_factory=lambda: ["*"], description="sandbox.env names allowed (fnmatch patterns); "
                           f"{', '.join(NEVER_ENV)} are never allowed")
    network: bool = Field(default=False, description="sandbox.network: true (outbound only, through its own network "
                          "namespace; never the host's loopback)")
    verifier_network: bool = Field(default=False, description="sandbox.verifierNetwork: true")
    data_roots: list[str] = Field(default_factory=list, description="directories tasks.source (datasets, harbor task "
                                  "directories) must lie beneath; read without following links out of them")
    backends: list[str] = Field(default_factory=list, description="URL prefixes llm.backends must start with "
                                "(with ownedBackends; empty: none — the namespace's jobs may name no backend)")
    owned_backends: list[str] = Field(default_factory=list, description="URL prefixes of backends this namespace "
                                      "owns: its trainer may pause, resume and reload them (announce a policy with "
                                      "pause or reload); a backend it does not own is shared and stays as it is")
    executor_overrides: bool = Field(default=False, description="jobs may set executor.slurm.setup and extraArgs "
                                     "and executor.kubernetes image and serviceAccount, runAsUser 0 or userNamespace false")
    quotas: TenantQuotas = Field(default_factory=TenantQuotas)

    _abs_roots = field_validator("data_roots")(classmethod(lambda cls, v: [_absolute(p) for p in v]))

    @field_validator("images")
    @classmethod
    def _images(cls, images: list[str]) -> list[str]:
        return [i if i == "host" else _absolute(i) for i in images]


RESTRICTED = TenantPolicySpec()


class TenantPolicy(Model):
    """apiVersion rolloutd.io/v1alpha1, kind TenantPolicy; metadata.name is the namespace it governs."""

    api_version: str = Field(default=f"{GROUP}/{VERSION}", alias="apiVersion")
    kind: Literal["TenantPolicy"] = POLICY_KIND
    metadata: dict = Field(default_factory=dict)
    spec: TenantPolicySpec = Field(default_factory=TenantPolicySpec)


def _url_allowed(url: str, prefixes: list[str]) -> bool:
    return any(url == p or url.startswith(p if p.endswith("/") else p + "/") for p in prefixes)


def owns_backend(policy: TenantPolicySpec | None, url: str) -> bool:
    """The namespace may pause, resume and reload the backend at `url` (None: the admin's job, always)."""
    return policy is None or _url_allowed(url, policy.owned_backends)


def violations(spec: "RolloutJobSpec", policy: TenantPolicySpec | None) -> list[tuple[str, str]]:
    """(field, why) for each part of `spec` that `policy` does not allow; empty when it allows all of it.

    Checks what the spec alone shows; quotas over the namespace (jobs, nodes, watches) and the rows a dataset
    holds are the controller's to count, links under a data root the reader's to refuse."""
    if policy is None:
        return []
    out: list[tuple[str, str]] = []
    box = spec.sandbox
    if box.runtime not in policy.runtimes:
        out.append(("spec.sandbox.runtime", f"{box.runtime!r} is not allowed (allowed: {', '.join(policy.runtimes)})"))
    if box.image != "host":
        image = posixpath.normpath(box.image) if box.image.startswith("/") else box.image
        if not any(i != "host" and image.startswith("/") and beneath(image, i) for i in policy.images):
            out.append(("spec.sandbox.image", f"{box.image!r} is not an allowed image"))
    elif "host" not in policy.images:
        out.append(("spec.sandbox.image", "'host' is not an allowed image"))
    for i, m in enumerate(box.mounts):
        grant = next((g for g in policy.volumes if beneath(posixpath.normpath(m.host_path), g.host_path)), None)
        if grant is None:
            out.append((f"spec.sandbox.mounts[{i}].hostPath", f"{m.host_path!r} is not beneath a volume the policy grants"))
        elif not m.read_only and grant.read_only:
            out.append((f"spec.sandbox.mounts[{i}].readOnly", f"{grant.host_path!r} is granted read-only"))
    if box.user is not None and box.image == "host" and box.user not in policy.users:
        out.append(("spec.sandbox.user", f"host user {box.user!r} is not allowed"))
    for name in box.env:
        if any(fnmatch.fnmatchcase(name, p) for p in NEVER_ENV) or not any(
                fnmatch.fnmatchcase(name, p) for p in policy.env):
            out.append((f"spec.sandbox.env.{name}", "this variable is not allowed"))
    if box.network and not policy.network:
        out.append(("spec.sandbox.network", "network is not allowed"))
    if box.verifier_network and not policy.verifier_network:
        out.append(("spec.sandbox.verifierNetwork", "the verifier's network is not allowed"))
    source = spec.tasks.source
    if not source.startswith("/") or not any(beneath(posixpath.normpath(source), r) for r in policy.data_roots):
        roots = ", ".join(policy.data_roots) or "none granted"
        out.append(("spec.tasks.source", f"must be an absolute path beneath a data root ({roots})"))
    allowed = [*policy.backends, *policy.owned_backends]  # an explicit list: empty allows none (#36)
    for i, b in enumerate(spec.llm.backends):
        if not _url_allowed(b.url, allowed):
            out.append((f"spec.llm.backends[{i}].url", "is not an allowed backend" if allowed else
                        "is not an allowed backend (the policy lists none: the admin names them in spec.backends)"))
    ex = spec.executor
    if not policy.executor_overrides:
        if ex.slurm.setup:
            out.append(("spec.executor.slurm.setup", "executor overrides are not allowed"))
        if ex.slurm.extra_args:
            out.append(("spec.executor.slurm.extraArgs", "executor overrides are not allowed"))
        k8s = ex.kubernetes
        for field, loosened in (("image", k8s.image is not None), ("serviceAccount", k8s.service_account is not None),
                                ("runAsUser", k8s.run_as_user == 0), ("userNamespace", not k8s.user_namespace)):
            if loosened:
                out.append((f"spec.executor.kubernetes.{field}", "executor overrides are not allowed"))
    q = policy.quotas
    if ex.nodes > q.nodes:
        out.append(("spec.executor.nodes", f"{ex.nodes} is over the namespace's node quota ({q.nodes})"))
    lim = box.limits
    if lim.cpus is None or lim.cpus > q.sandbox_cpus:
        out.append(("spec.sandbox.limits.cpus", f"{lim.cpus} is over the quota of {q.sandbox_cpus} cores per sandbox"))
    if lim.memory_mb > q.sandbox_memory_mb:
        out.append(("spec.sandbox.limits.memoryMB", f"{lim.memory_mb} is over the quota of {q.sandbox_memory_mb} MB"))
    if lim.workspace_mb is None or lim.workspace_mb > q.workspace_mb:
        out.append(("spec.sandbox.limits.workspaceMB", f"{lim.workspace_mb} is over the quota of {q.workspace_mb} MB"))
    for field, asked, most in (("processes", lim.processes, q.sandbox_processes), ("tmpMB", lim.tmp_mb, q.tmp_mb),
                               ("wallSeconds", lim.wall_seconds, q.wall_seconds)):
        if asked > most:
            out.append((f"spec.sandbox.limits.{field}", f"{asked} is over the quota of {most}"))
    t = spec.timeouts
    for field, asked in (("initSeconds", t.init_seconds), ("runSeconds", t.run_seconds),
                         ("evalSeconds", t.eval_seconds), ("actionSeconds", t.action_seconds)):
        if asked > q.stage_seconds:
            out.append((f"spec.timeouts.{field}", f"{asked} is over the quota of {q.stage_seconds} seconds"))
    budget = spec.agent.sampling.max_total_tokens
    if q.max_total_tokens is not None and budget > q.max_total_tokens:
        out.append(("spec.agent.sampling.maxTotalTokens", f"{budget} is over the quota of {q.max_total_tokens} tokens"))
    if spec.priority > q.priority:
        out.append(("spec.priority", f"{spec.priority} is over the namespace's largest priority ({q.priority})"))
    w = spec.pipeline.workers_per_node
    held = w.init + w.run + w.eval + box.warm
    if held > q.sandboxes_per_node:
        out.append(("spec.pipeline.workersPerNode", f"init + run + eval + sandbox.warm = {held} sandboxes per node, "
                    f"over the quota ({q.sandboxes_per_node})"))
    return out
