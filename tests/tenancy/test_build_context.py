"""A tenant's Harbor task directory never steers what the image builder reads as root: the builder gets a
private copy read beneath the job's data roots as nobody, and a Dockerfile that is a link is refused.

The builder hashes the context, reads the Dockerfile and copies COPY sources as root; before, a task whose
`environment/Dockerfile` linked to a root-only file had it read (and quoted by parse errors), and a FIFO in the
context hung the hash, and so INIT.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from rolloutd.agents.tasks.base import ConfigError, HandlerScope
from rolloutd.agents.tasks.harbor import HarborTask
from rolloutd.sandbox.image.build import build_image
from rolloutd.sandbox.image.rootfs import ImageBuildError

SECRET = "FROM sEcReT-0f-the-host\nRUN top-secret-line\n"


@pytest.fixture
def area():
    """/tmp/…/{team-a/task/environment, outside/secret}: world-readable as the tenant reader needs; the secret
    is root-only."""
    base = Path(tempfile.mkdtemp(prefix="rolloutd-ctx-", dir="/tmp"))
    env = base / "team-a" / "task" / "environment"
    env.mkdir(parents=True)
    for d in (base, base / "team-a", base / "team-a" / "task", env):
        d.chmod(0o755)
    (base / "outside").mkdir(mode=0o700)
    secret = base / "outside" / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    yield base, env, secret
    shutil.rmtree(base, ignore_errors=True)


def _handler(roots: list[str] | None) -> HarborTask:
    handler = HarborTask()
    handler.bind(HandlerScope(roots=None if roots is None else tuple(roots)))
    return handler


def test_a_dockerfile_linking_to_a_root_only_file_is_never_read(area):
    base, env, secret = area
    (env / "Dockerfile").symlink_to(secret)
    for roots in ([str(base / "team-a")], None):  # the tenant's job, and the admin's
        with pytest.raises((ConfigError, ImageBuildError)) as refused:
            _handler(roots)._build(build_image, str(env.parent))
        text = str(refused.value)
        assert "sEcReT" not in text and "top-secret" not in text, text
        assert "link" in text


def test_a_fifo_in_a_tenants_context_fails_the_task_at_once(area):
    base, env, _secret = area
    (env / "Dockerfile").write_text("FROM debian:bookworm\nCOPY . /srv\n")
    (env / "Dockerfile").chmod(0o644)
    os.mkfifo(env / "pipe")
    os.chmod(env / "pipe", 0o644)
    with pytest.raises(ConfigError, match="spec.tasks.source"):  # before: the hash opened the FIFO and hung
        _handler([str(base / "team-a")])._build(build_image, str(env.parent))


def test_a_context_link_out_is_copied_as_a_link_never_as_the_file(area):
    """The private copy keeps a link as a link: the host file it names is neither read nor hashed."""
    from rolloutd.agents.tasks.harbor_files import snapshot

    base, env, secret = area
    (env / "Dockerfile").write_text("FROM debian:bookworm\n")
    (env / "Dockerfile").chmod(0o644)
    (env / "leak").symlink_to(secret)
    with snapshot(str(env.parent), [str(base / "team-a")]) as private:
        copied = private / "environment" / "leak"
        assert copied.is_symlink() and os.readlink(copied) == str(secret)
        assert (private / "environment" / "Dockerfile").read_text() == "FROM debian:bookworm\n"
    assert not private.exists()
