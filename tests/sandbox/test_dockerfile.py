"""The Dockerfile subset parser (sandbox/image/dockerfile.py): golden parses of real-task shapes, and every
refusal names the file and line."""
import pytest

from rolloutd.sandbox.image.dockerfile import Base, DockerfileError, Step, parse_dockerfile

GOLDEN = """\
# syntax=docker/dockerfile:1
ARG PY=3.12
FROM python:${PY}-slim AS env

ARG APP_USER=agent
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1
RUN apt-get update && \\
    # a comment inside a continuation is dropped
    apt-get install -y --no-install-recommends \\
        git jq && \\
    rm -rf /var/lib/apt/lists/*
RUN ["pip", "install", "pytest==8.3.3"]
WORKDIR /app
COPY --chown=${APP_USER}:${APP_USER} data/ ./data/
ADD seed.tar.gz /opt/seed
ENV DATA_DIR=$PWD/data HOME_DIR=${HOME:-/root}
ENV LEGACY value with spaces
USER ${APP_USER}
LABEL maintainer="someone"
CMD ["bash"]
"""


def test_golden_parse():
    df = parse_dockerfile(GOLDEN)
    assert df.base == Base("python:3.12-slim", "python", "3.11", df.base.notes)
    assert "Python 3.12" in df.base.notes[0] and "3.11" in df.base.notes[0]
    assert [(s.line, s.op) for s in df.steps] == [
        (5, "ARG"), (6, "ENV"), (7, "RUN"), (12, "RUN"), (13, "WORKDIR"), (14, "COPY"), (15, "ADD"),
        (16, "ENV"), (17, "ENV"), (18, "USER")]
    steps = {s.line: s for s in df.steps}
    assert steps[5].options == (("APP_USER", "agent"),)
    assert steps[6].options == (("DEBIAN_FRONTEND", "noninteractive"), ("PIP_NO_CACHE_DIR", "1"))
    assert steps[7].args == ("apt-get update && apt-get install -y --no-install-recommends git jq && "
                             "rm -rf /var/lib/apt/lists/*",)
    assert steps[12] == Step(12, "RUN", ("pip", "install", "pytest==8.3.3"), exec_form=True)
    assert steps[14].args == ("data/", "./data/") and steps[14].options == (("chown", "agent:agent"),)
    assert steps[15].args == ("seed.tar.gz", "/opt/seed")
    # unset variables are empty, ${X:-default} falls back
    assert steps[16].options == (("DATA_DIR", "/data"), ("HOME_DIR", "/root"))
    assert steps[17].options == (("LEGACY", "value with spaces"),)
    assert steps[18].args == ("agent",)
    assert any("LABEL skipped" in n for n in df.notes) and any("CMD skipped" in n for n in df.notes)


@pytest.mark.parametrize("ref, flavor, mapped_note", [
    ("python:3.11-slim", "python", False),
    ("python:3.13-slim-bookworm", "python", True),
    ("debian:bookworm", "debian", False),
    ("debian:bookworm-slim", "debian", False),
    ("ubuntu:24.04", "debian", True),
    ("ubuntu:22.04", "debian", True),
])
def test_bases_map_to_bookworm(ref, flavor, mapped_note):
    df = parse_dockerfile(f"FROM {ref}\nRUN true\n")
    assert (df.base.flavor, df.base.python) == (flavor, "3.11")
    assert bool(df.base.notes) is mapped_note


def test_build_args_override_defaults():
    df = parse_dockerfile("FROM debian:bookworm\nARG V=1\nRUN echo $V\n", build_args={"V": "2"})
    assert df.steps[0].options == (("V", "2"),)


@pytest.mark.parametrize("text, message", [
    ("FROM debian:bookworm\nRUN true\n\n# check\nHEALTHCHECK CMD curl -f localhost\n",
     "Dockerfile:5: HEALTHCHECK is not supported"),
    ("FROM alpine:3.20\n", "Dockerfile:1: FROM alpine:3.20 is not supported"),
    ("FROM nvidia/cuda:12.4.0-base-ubuntu22.04\n", "Dockerfile:1: FROM nvidia/cuda"),
    ("FROM python:3.12 AS build\nRUN true\nFROM debian:bookworm\n", "Dockerfile:3: a second FROM"),
    ("FROM debian:bookworm\nCOPY --from=build /x /y\n", "Dockerfile:2: COPY --from is not supported"),
    ("FROM debian:bookworm\nADD https://example.org/x.tgz /x\n", "Dockerfile:2: ADD from a URL"),
    ("FROM debian:bookworm\nRUN --mount=type=cache,target=/x true\n", "Dockerfile:2: RUN --mount"),
    ("FROM debian:bookworm\nRUN <<EOF\necho hi\nEOF\n", "Dockerfile:2: RUN with a here-document"),
    ("FROM debian:bookworm\nSHELL [\"/bin/bash\", \"-c\"]\n", "Dockerfile:2: SHELL is not supported"),
    ("FROM debian:bookworm\nVOLUME /data\n", "Dockerfile:2: VOLUME is not supported"),
    ("RUN true\n", "Dockerfile:1: RUN before FROM"),
    ("FROM debian:bookworm\nENV A=1 B\n", "Dockerfile:2: ENV needs KEY=VALUE, got 'B'"),
    ("# only a comment\n", "Dockerfile: no FROM line"),
    ("FROM debian:bookworm\nCOPY a b c\n", "Dockerfile:2: COPY with several sources needs a destination ending in '/'"),
    ("# escape=`\nFROM debian:bookworm\n", "Dockerfile:1: the escape directive"),
    ("FROM debian:bookworm\nRUN [" + "1" * 5000 + "]\n", "Dockerfile:2: the JSON form: a value cannot be read"),  # ValueError
    ("FROM debian:bookworm\nRUN " + "[" * 100_000 + "]" * 100_000 + "\n",  # was a RecursionError
     "Dockerfile:2: the JSON form: nests too deeply"),
])
def test_outside_the_subset_names_the_line(text, message):
    with pytest.raises(DockerfileError) as e:
        parse_dockerfile(text)
    assert str(e.value).startswith(message), str(e.value)
