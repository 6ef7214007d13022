"""The runtimes' registry (sandbox/runtimes/__init__.py): the `rolloutd.sandbox.runtimes` entry points are
exactly the spec's list of kinds (`crds.rolloutjob.RuntimeKind`), each class answers to its own name, and a
name nobody registered is refused with the list."""
from __future__ import annotations

from typing import get_args

import pytest

from rolloutd.crds.rolloutjob import RuntimeKind, SandboxSpec
from rolloutd.crds.tenancy import TenantPolicySpec
from rolloutd.sandbox.runtimes import registered, runtime_class
from rolloutd.sandbox.runtimes.base import SandboxRuntime


def test_the_registry_is_the_specs_list_of_kinds():
    assert sorted(registered()) == sorted(get_args(RuntimeKind))


@pytest.mark.parametrize("name", get_args(RuntimeKind))
def test_each_runtime_answers_to_its_name(name):
    cls = runtime_class(name)
    assert issubclass(cls, SandboxRuntime) and cls.name == name


def test_the_spec_and_the_policy_take_the_same_kinds():
    for name in get_args(RuntimeKind):
        assert SandboxSpec(runtime=name).runtime == name
        assert TenantPolicySpec(runtimes=[name]).runtimes == [name]
    with pytest.raises(ValueError):
        SandboxSpec(runtime="docker")
    with pytest.raises(ValueError, match=r"unknown sandbox runtime 'docker'; choose one of \['apptainer', 'bwrap'"):
        runtime_class("docker")
