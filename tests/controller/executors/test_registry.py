"""The executors' registry (controller/executors/__init__.py): the `rolloutd.controller.executors` entry points are
exactly the spec's list of kinds (`crds.executor.ExecutorKind`), each class answers to its own kind and is built
from a `Site`, and a kind nobody registered is refused with the list."""
from __future__ import annotations

from typing import get_args

import pytest

from rolloutd.controller.executors import executor_class, make, registered
from rolloutd.controller.executors.base import Site
from rolloutd.controller.access.nodeauth import NodeCredentials
from rolloutd.controller.server import EXECUTOR_KINDS
from rolloutd.crds.executor import ExecutorKind, ExecutorSpec
from rolloutd.crds.kit.settings import ControllerSettings


def test_the_registry_is_the_specs_list_of_kinds():
    assert sorted(registered()) == sorted(get_args(ExecutorKind)) == sorted(EXECUTOR_KINDS)
    for kind in get_args(ExecutorKind):
        assert ExecutorSpec(kind=kind).kind == kind
    with pytest.raises(ValueError):
        ExecutorSpec(kind="pbs")


def test_each_kind_is_built_from_a_site_and_answers_to_its_name(tmp_path):
    asked = []

    def remote() -> str:
        asked.append(1)
        return "http://controller.example:8080"

    site = Site(tmp_path, NodeCredentials(None), ControllerSettings(k8s_namespace="rl"), local_url="http://127.0.0.1:1",
                remote_url=remote)
    made = make(get_args(ExecutorKind), site)
    assert {kind: type(ex).kind for kind, ex in made.items()} == {k: k for k in get_args(ExecutorKind)}
    assert made["local"].controller_url == "http://127.0.0.1:1" and made["local"].shares_files
    assert {made[k].controller_url for k in ("slurm", "kubernetes")} == {"http://controller.example:8080"}
    assert made["kubernetes"].namespace == "rl" and len(asked) == 2  # the remote address only for remote daemons


def test_an_unknown_kind_is_refused_with_the_list():
    with pytest.raises(ValueError, match=r"unknown executor 'pbs'; choose one of \['kubernetes', 'local', 'slurm'\]"):
        executor_class("pbs")
