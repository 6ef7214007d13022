"""`rolloutctl`'s `-f` reader (controller/ctl/files.py): a document that is not a mapping is refused naming the kind
the command reads (a job for `apply`, a tenant policy for `policy apply`), and nothing is sent."""
from __future__ import annotations

import pytest
import typer

from rolloutd.controller.ctl.files import read_documents


def _fail(message: str) -> typer.Exit:
    raise AssertionError(message)


@pytest.mark.parametrize("kind", ["RolloutJob", "TenantPolicy"])
def test_a_document_that_is_not_a_mapping_names_the_kind_read(tmp_path, kind):
    path = tmp_path / "doc.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(AssertionError, match=f"expected a {kind} mapping, got list"):
        read_documents(str(path), _fail, kind)


def test_a_mapping_is_read_with_its_relative_paths_resolved(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("kind: TenantPolicy\nmetadata: {name: p}\n")
    assert read_documents(str(path), _fail, "TenantPolicy") == [{"kind": "TenantPolicy", "metadata": {"name": "p"}}]
