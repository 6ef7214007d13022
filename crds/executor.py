"""Where a RolloutJob's node daemons run: `spec.executor` (local processes, a Slurm allocation, a Kubernetes Indexed Job).

Part of the RolloutJob resource (rolloutjob.py); the controller's executors (controller/executors/) act on it.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from .base import Model
from .k8s_names import DNS1123_LABEL, valid_label_key

_SLURM_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^(infinite|UNLIMITED)$")


class SlurmSpec(Model):
    """The Slurm allocation (`executor.kind: slurm`): one `rolloutd node` per allocated node."""

    partition: str | None = Field(default=None, description="sbatch --partition")
    time_limit: str | None = Field(default=None, description="Slurm time limit, e.g. 01:00:00 or 2-00:00:00")
    account: str | None = Field(default=None, description="sbatch --account")
    qos: str | None = Field(default=None, description="sbatch --qos")
    constraint: str | None = Field(default=None, description="sbatch --constraint (node features)")
    extra_args: list[str] = Field(default_factory=list, description="extra sbatch arguments")
    setup: list[str] = Field(default_factory=list, description="shell lines run before the daemons (module load …)")

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        if v is not None and not _SLURM_TIME.match(v):
            raise ValueError("must be a Slurm time limit such as 30, 01:00:00 or 1-12:00:00")
        return v


_QUANTITY = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
_DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


class PodResources(Model):
    """The daemon container's resources, as in a Kubernetes pod spec."""

    requests: dict[str, str] = Field(default_factory=dict, description="e.g. {cpu: '2', memory: 8Gi}")
    limits: dict[str, str] = Field(default_factory=dict, description="e.g. {memory: 16Gi}")

    @field_validator("requests", "limits")
    @classmethod
    def _quantities(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not valid_label_key(key):
                raise ValueError(f"{key!r} is not a resource name")
            if not re.match(_QUANTITY, value):
                raise ValueError(f"{key}: {value!r} is not a Kubernetes quantity (e.g. 500m, 2, 8Gi)")
        return v


class KubernetesSpec(Model):
    """The node daemons as one Indexed Job (a pod per node). Defaults come from the controller's
    environment ($ROLLOUTD_K8S_NODE_IMAGE, $ROLLOUTD_K8S_NAMESPACE: the Helm chart sets both)."""

    image: str | None = Field(default=None, min_length=1, description="node daemon image (default: the controller's)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="the pod's imagePullPolicy (default: Kubernetes' own)")
    namespace: str | None = Field(default=None, max_length=63, pattern=DNS1123_LABEL.pattern,
                                  description="where the Job runs (default: the controller's executor namespace)")
    service_account: str | None = Field(default=None, max_length=253, pattern=_DNS1123_SUBDOMAIN,
                                        description="the pods' service account (default: the namespace's)")
    resources: PodResources = Field(default_factory=PodResources, description="requests and limits of the daemon "
                                    "container")
    node_selector: dict[str, str] = Field(default_factory=dict, description="the pods' nodeSelector")
    # bwrap builds each sandbox from user namespaces: an unprivileged daemon, and a pod whose seccomp and
    # AppArmor profiles allow unshare/mount (RuntimeDefault forbids both) - see the README's Kubernetes section
    run_as_user: int = Field(default=1000, ge=1, description="the daemon's uid (not root: bwrap then uses user "
                             "namespaces)")
    seccomp_profile: Literal["Unconfined", "RuntimeDefault"] = Field(
        default="Unconfined", description="the pod's seccomp profile (RuntimeDefault refuses what bwrap needs)")
    app_armor_profile: Literal["Unconfined", "RuntimeDefault"] = Field(
        default="Unconfined", description="the pod's AppArmor profile (RuntimeDefault refuses what bwrap needs)")
    user_namespace: bool = Field(default=True, description="hostUsers: false + procMount: Unmasked, so bwrap can "
                                 "mount a fresh /proc (Kubernetes >= 1.33)")


# The executors a spec may name: the `rolloutd.controller.executors` entry points (pyproject.toml), kept equal to
# this list by tests/controller/executors/test_registry.py. A plug-in adds its name here (docs: write-an-executor.md).
ExecutorKind = Literal["local", "slurm", "kubernetes"]


class ExecutorSpec(Model):
    """Where the node daemons run."""

    kind: ExecutorKind = Field(
        default="local", description="local (subprocesses of the controller), slurm (an allocation) or kubernetes "
        "(an Indexed Job)")
    nodes: int = Field(default=1, ge=0, le=4096, description="node daemons to run (Slurm nodes, pods)")
    slurm: SlurmSpec = Field(default_factory=SlurmSpec, description="used by executor.kind slurm")
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec)
