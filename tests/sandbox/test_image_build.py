"""`rolloutd image build`: Docker's COPY/ADD/WORKDIR/ENV/ARG/RUN rules replayed in a real bookworm rootfs,
the content-keyed cache, the CLI, and failures that name the Dockerfile line. The base is built once
(~35 s, cached under ~/.cache/rolloutd/images; tests/agents/tasks/test_harbor.py shares it)."""
import gzip
import io
import os
import shutil
import tarfile

import pytest
from typer.testing import CliRunner

from rolloutd.controller.main import app
from rolloutd.sandbox.image.build import build_image
from rolloutd.sandbox.image.rootfs import ImageBuildError

DOCKERFILE = """\
FROM debian:bookworm-slim
ARG GREETING=hello
ENV TARGET=/srv/app LIST="a b"
WORKDIR $TARGET
COPY one.txt ./
COPY conf/ etc/
COPY *.md docs/
COPY one.txt /opt/renamed.txt
COPY --chmod=0700 tool.sh /usr/local/bin/tool
ADD bundle.tar.gz /opt/bundle
WORKDIR sub
RUN echo "$GREETING from $(pwd) $LIST" > /srv/app/greeting.txt
RUN ["/bin/sh", "-c", "id -u > /srv/app/uid.txt"]
"""


def _context(tmp_path, dockerfile=DOCKERFILE):
    ctx = tmp_path / "ctx"
    (ctx / "conf" / "nested").mkdir(parents=True, exist_ok=True)
    (ctx / "Dockerfile").write_text(dockerfile)
    (ctx / "one.txt").write_text("one\n")
    (ctx / "conf" / "a.ini").write_text("a\n")
    (ctx / "conf" / "nested" / "b.ini").write_text("b\n")
    (ctx / "README.md").write_text("readme\n")
    (ctx / "NOTES.md").write_text("notes\n")
    (ctx / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    data, raw = b"inside the tarball\n", io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("pkg/data.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    (ctx / "bundle.tar.gz").write_bytes(gzip.compress(raw.getvalue(), mtime=0))  # same bytes every time
    return ctx


@pytest.fixture(scope="module")
def needs_builder():
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None or os.geteuid() != 0:
        pytest.skip("image builds need bwrap, mmdebstrap and root here (bash .ci/system-packages.sh)")


def test_docker_rules(needs_builder, tmp_path):
    image = build_image(_context(tmp_path), log=lambda m: None)
    root, seed = image.rootfs, image.seed  # WORKDIR /srv/app/sub: its files live in the seed
    assert image.workdir == "/srv/app/sub" and image.writable_workdir
    assert (root / "srv/app/one.txt").read_text() == "one\n"
    assert (root / "srv/app/etc/a.ini").read_text() == "a\n"                 # a directory's contents
    assert (root / "srv/app/etc/nested/b.ini").read_text() == "b\n"
    assert sorted(os.listdir(root / "srv/app/docs")) == ["NOTES.md", "README.md"]  # a glob into a dir/
    assert (root / "opt/renamed.txt").read_text() == "one\n"                # a file to a new name
    assert oct((root / "usr/local/bin/tool").stat().st_mode & 0o777) == "0o700"
    assert (root / "opt/bundle/pkg/data.txt").read_text() == "inside the tarball\n"  # ADD extracts
    assert (root / "srv/app/greeting.txt").read_text() == "hello from /srv/app/sub a b\n"
    assert (root / "srv/app/uid.txt").read_text() == "0\n"
    assert os.readlink(root / "srv/app/sub") == "/workspace" and list(seed.iterdir()) == []
    assert os.readlink(root / "logs") == "/.rolloutd/harbor/logs"  # the control directory: agents cannot write it
    assert image.env == {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                         "TARGET": "/srv/app", "LIST": "a b"}
    assert "Bootstrap: localimage" in (image.path / "Apptainer.def").read_text()
    if shutil.which("apptainer") is None and shutil.which("singularity") is None:
        assert any("no .sif built" in n for n in image.notes)

    again = build_image(_context(tmp_path), log=lambda m: None)
    assert again.cached and again.key == image.key
    changed = _context(tmp_path)
    (changed / "one.txt").write_text("two\n")                              # content is part of the key
    assert build_image(changed, log=lambda m: None).key != image.key


def test_a_failing_step_names_its_line(needs_builder, tmp_path):
    ctx = _context(tmp_path, "FROM debian:bookworm\nRUN true\nRUN echo broken >&2; exit 3\n")
    with pytest.raises(ImageBuildError, match=r"(?s)Dockerfile:3: RUN failed with exit code 3:.*broken"):
        build_image(ctx, log=lambda m: None)
    ctx = _context(tmp_path, "FROM debian:bookworm\nCOPY missing.txt /x\n")
    with pytest.raises(ImageBuildError, match=r"Dockerfile:2: 'missing.txt' not found in the build context"):
        build_image(ctx, log=lambda m: None)
    ctx = _context(tmp_path, "FROM debian:bookworm\nCOPY ../../etc/passwd /x\n")
    with pytest.raises(ImageBuildError, match=r"Dockerfile:2: '../../etc/passwd' leaves the build context"):
        build_image(ctx, log=lambda m: None)


def test_cli(needs_builder, tmp_path):
    ctx = _context(tmp_path)
    runner = CliRunner()
    first = runner.invoke(app, ["image", "build", str(ctx)])
    assert first.exit_code == 0, first.output
    assert first.stdout.strip().endswith("/rootfs") and os.path.isdir(first.stdout.strip())
    (ctx / "Dockerfile").write_text("FROM debian:bookworm\n\nHEALTHCHECK CMD true\n")
    bad = runner.invoke(app, ["image", "build", str(ctx)])
    assert bad.exit_code == 1 and "Dockerfile:3: HEALTHCHECK is not supported" in bad.output
