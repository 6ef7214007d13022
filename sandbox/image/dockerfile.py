"""The Dockerfile subset `rolloutd image build` understands: parse a task's Dockerfile into steps.

Where it sits: `image_build.build_image` calls `parse_dockerfile` and replays the steps in a
bookworm root filesystem (see image_build.py); nothing here touches the disk beyond reading text.

Supported: one `FROM` of a Debian, Ubuntu or python base (all mapped to Debian bookworm, see
`map_base`), `RUN` (shell and JSON forms), `COPY`/`ADD` from the build context (`--chown`,
`--chmod`; `ADD` of a local tar archive extracts it), `WORKDIR`, `ENV`, `USER`, `ARG`, with
`$VAR`/`${VAR}`/`${VAR:-x}`/`${VAR:+x}` substitution. `LABEL`, `EXPOSE`, `CMD`, `ENTRYPOINT` and
`MAINTAINER` change nothing a rollout sees and are skipped with a note. Anything else fails with
`DockerfileError("Dockerfile:LINE: ... is not supported")`.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from rolloutd.crds.errors import ConfigurationError
from rolloutd.crds.kit.documents import unreadable


BOOKWORM_PYTHON = "3.11"  # Debian 12's python3
SKIPPED = {"LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "MAINTAINER"}
SUPPORTED = {"FROM", "RUN", "COPY", "ADD", "WORKDIR", "ENV", "USER", "ARG"} | SKIPPED
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2")


class DockerfileError(ConfigurationError, ValueError):
    """The Dockerfile is outside the supported subset or malformed; the message names the line."""


@dataclass(frozen=True)
class Base:
    """What a `FROM` maps to: always a Debian bookworm root filesystem, in one of three flavours."""

    ref: str            # as written, e.g. "python:3.12-slim"
    flavor: str         # "python" (python:3.x images: python/pip on PATH, pip installs allowed) | "debian"
    python: str = BOOKWORM_PYTHON
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Step:
    line: int
    op: str                     # RUN | COPY | ADD | WORKDIR | ENV | USER | ARG
    args: tuple[str, ...] = ()  # RUN: (command,) or argv (exec form); COPY/ADD: sources + dest
    options: tuple[tuple[str, str], ...] = ()  # COPY/ADD --chown/--chmod; ENV/ARG pairs
    exec_form: bool = False


@dataclass
class Dockerfile:
    base: Base
    steps: list[Step]
    notes: list[str] = field(default_factory=list)  # skipped instructions, base mapping warnings


def parse_dockerfile(text: str, *, name: str = "Dockerfile", build_args: dict[str, str] | None = None) -> Dockerfile:
    """Parse `text` (the contents of `name`) into a `Dockerfile`; raise `DockerfileError` naming the line."""
    args: dict[str, str] = {}          # ARG values in scope (global ARGs before FROM feed FROM only)
    given = dict(build_args or {})
    env: dict[str, str] = {}
    base: Base | None = None
    steps: list[Step] = []
    notes: list[str] = []
    for line, instruction, rest in _logical_lines(text, name):
        where = f"{name}:{line}"
        if instruction not in SUPPORTED:
            raise DockerfileError(f"{where}: {instruction} is not supported (rolloutd image build supports "
                                  f"{', '.join(sorted(SUPPORTED - SKIPPED))})")
        if instruction == "ARG":
            pairs = _arg_pairs(rest, where)
            for key, default in pairs:
                value = given.get(key, _subst(default, {**args, **env}, where) if default is not None else None)
                if value is not None:
                    args[key] = value
            if base is not None:
                steps.append(Step(line, "ARG", options=tuple((k, args.get(k, "")) for k, _ in pairs)))
            continue
        if instruction == "FROM":
            if base is not None:
                raise DockerfileError(f"{where}: a second FROM (multi-stage build) is not supported")
            words = rest.split()
            if words and words[0].startswith("--"):
                raise DockerfileError(f"{where}: FROM {words[0]} is not supported")
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
                raise DockerfileError(f"{where}: FROM takes an image and an optional 'AS name'")
            base = map_base(_subst(words[0], args, where), where)
            notes.extend(base.notes)
            args = {k: v for k, v in args.items() if k in given}  # ARGs before FROM leave scope
            continue
        if base is None:
            raise DockerfileError(f"{where}: {instruction} before FROM")
        if instruction in SKIPPED:
            notes.append(f"{where}: {instruction} skipped (it does not change the filesystem a rollout sees)")
            continue
        scope = {**args, **env}
        if instruction == "RUN":
            steps.append(_run_step(line, rest, where))
        elif instruction in ("COPY", "ADD"):
            steps.append(_copy_step(line, instruction, rest, scope, where))
        elif instruction == "WORKDIR":
            path = _subst(rest.strip(), scope, where)
            if not path:
                raise DockerfileError(f"{where}: WORKDIR needs a path")
            steps.append(Step(line, "WORKDIR", (path,)))
        elif instruction == "ENV":
            pairs = [(k, _subst(v, scope, where)) for k, v in _env_pairs(rest, where)]
            env.update(pairs)
            steps.append(Step(line, "ENV", options=tuple(pairs)))
        elif instruction == "USER":
            user = _subst(rest.strip(), scope, where)
            if not user or " " in user:
                raise DockerfileError(f"{where}: USER takes one user[:group]")
            steps.append(Step(line, "USER", (user,)))
    if base is None:
        raise DockerfileError(f"{name}: no FROM line")
    return Dockerfile(base=base, steps=steps, notes=notes)


def load_dockerfile(path: Path, build_args: dict[str, str] | None = None) -> Dockerfile:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DockerfileError(f"{path}: cannot read: {e}") from None
    return parse_dockerfile(text, name=path.name, build_args=build_args)


# ---------------------------------------------------------------------- FROM
_PYTHON = re.compile(r"^(?:docker\.io/)?(?:library/)?python:(\d+)\.(\d+)(?:\.\d+)?(?:-(?:slim|bookworm|slim-bookworm|"
                     r"bullseye|slim-bullseye|trixie|slim-trixie))?$")
_DEBIAN = re.compile(r"^(?:docker\.io/)?(?:library/)?debian:(bookworm|12)(?:[.\d]*)?(?:-slim)?(?:-\d+)?$")
_OTHER_DEBIAN = re.compile(r"^(?:docker\.io/)?(?:library/)?(debian|ubuntu|buildpack-deps)(?::([\w.-]+))?$")


def map_base(ref: str, where: str) -> Base:
    """Map an image reference onto the bookworm root filesystem; refuse what cannot be mapped honestly."""
    ref = ref.split("@", 1)[0]  # a digest pins a Docker image we never pull
    m = _PYTHON.match(ref)
    if m:
        version = f"{m.group(1)}.{m.group(2)}"
        notes = () if version == BOOKWORM_PYTHON else (
            f"{where}: {ref} asks for Python {version}; the image has Debian bookworm's Python {BOOKWORM_PYTHON}",)
        return Base(ref, "python", BOOKWORM_PYTHON, notes)
    if _DEBIAN.match(ref):
        return Base(ref, "debian")
    m = _OTHER_DEBIAN.match(ref)
    if m:
        return Base(ref, "debian", notes=(f"{where}: {ref} is mapped to Debian bookworm (same apt and dpkg; "
                                          "package versions are bookworm's)",))
    raise DockerfileError(f"{where}: FROM {ref} is not supported (python:3.x, debian:bookworm and ubuntu "
                          "bases are, all mapped to Debian bookworm)")


# ---------------------------------------------------------------------- instructions
def _run_step(line: int, rest: str, where: str) -> Step:
    text = rest.strip()
    if text.startswith("--"):
        raise DockerfileError(f"{where}: RUN {text.split()[0]} is not supported")
    if text.startswith("["):
        argv = _json_array(text, where)
        if argv is not None:
            return Step(line, "RUN", tuple(argv), exec_form=True)
    if not text:
        raise DockerfileError(f"{where}: RUN needs a command")
    return Step(line, "RUN", (text,))


def _copy_step(line: int, op: str, rest: str, scope: dict[str, str], where: str) -> Step:
    text = rest.strip()
    words = _json_array(text, where) if text.startswith("[") else None
    if words is None:
        try:
            words = shlex.split(text, posix=True)
        except ValueError as e:
            raise DockerfileError(f"{where}: {op}: {e}") from None
    options: list[tuple[str, str]] = []
    while words and words[0].startswith("--"):
        flag, _, value = words.pop(0)[2:].partition("=")
        if flag not in ("chown", "chmod"):
            raise DockerfileError(f"{where}: {op} --{flag} is not supported")
        if flag == "chmod" and not re.fullmatch(r"[0-7]{3,4}", value):
            raise DockerfileError(f"{where}: {op} --chmod takes an octal mode")
        options.append((flag, _subst(value, scope, where)))
    words = [_subst(w, scope, where) for w in words]
    if len(words) < 2:
        raise DockerfileError(f"{where}: {op} needs at least one source and a destination")
    for src in words[:-1]:
        if re.match(r"^[a-z][a-z0-9+.-]*://", src):
            raise DockerfileError(f"{where}: {op} from a URL is not supported (the build context only)")
    if len(words) > 2 and not words[-1].endswith("/"):
        raise DockerfileError(f"{where}: {op} with several sources needs a destination ending in '/'")
    return Step(line, op, tuple(words), tuple(options))


def _env_pairs(rest: str, where: str) -> list[tuple[str, str]]:
    text = rest.strip()
    first = text.split(None, 1)[0] if text else ""
    if "=" not in first:  # legacy `ENV KEY value with spaces`
        parts = text.split(None, 1)
        if len(parts) != 2:
            raise DockerfileError(f"{where}: ENV needs KEY=VALUE (or KEY VALUE)")
        return [(parts[0], parts[1])]
    pairs = []
    for word in _words(text, where):
        key, eq, value = word.partition("=")
        if not eq or not key:
            raise DockerfileError(f"{where}: ENV needs KEY=VALUE, got {word!r}")
        pairs.append((key, value))
    return pairs


def _arg_pairs(rest: str, where: str) -> list[tuple[str, str | None]]:
    pairs = []
    for word in _words(rest, where):
        key, eq, value = word.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise DockerfileError(f"{where}: ARG name {key!r} is not valid")
        pairs.append((key, value if eq else None))
    if not pairs:
        raise DockerfileError(f"{where}: ARG needs a name")
    return pairs


def _words(text: str, where: str) -> list[str]:
    """Split like the shell, keeping `$VAR` references for `_subst` (quotes removed)."""
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=False)
        lexer.whitespace_split = True
        lexer.escape = ""  # a backslash is kept (e.g. in Windows-free paths and regexes)
        return list(lexer)
    except ValueError as e:
        raise DockerfileError(f"{where}: {e}") from None


def _json_array(text: str, where: str) -> list[str] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None  # not JSON: Docker reads it as the shell form too
    except (ValueError, RecursionError) as e:  # JSON Python cannot read: 4300+ digits, deep nesting
        raise DockerfileError(f"{where}: the JSON form: {unreadable(e)}") from None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise DockerfileError(f"{where}: the JSON form must be a non-empty array of strings")
    return value


_VAR = re.compile(r"\\\$|\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def _subst(text: str, scope: dict[str, str], where: str) -> str:
    def one(m: re.Match) -> str:
        if m.group(0) == "\\$":
            return "$"
        name = m.group(1) or m.group(4)
        value = scope.get(name)
        if m.group(2) == ":-":
            return value if value else m.group(3)
        if m.group(2) == ":+":
            return m.group(3) if value else ""
        return value or ""

    if "${" in text and not re.search(r"\$\{[^}]*\}", text):
        raise DockerfileError(f"{where}: unterminated ${{...}} in {text!r}")
    return _VAR.sub(one, text)


# ---------------------------------------------------------------------- lines
_HEREDOC = re.compile(r"<<-?\s*['\"]?[A-Za-z_][A-Za-z0-9_]*['\"]?")


def _logical_lines(text: str, name: str):
    """(first line number, INSTRUCTION, rest) per instruction: comments dropped, `\\` continuations joined."""
    lines = text.splitlines()
    i = 0
    directives_open = True
    while i < len(lines):
        raw = lines[i]
        start = i + 1
        i += 1
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            m = re.match(r"#\s*(\w+)\s*=\s*(\S+)", stripped)
            if directives_open and m and m.group(1).lower() == "escape" and m.group(2) != "\\":
                raise DockerfileError(f"{name}:{start}: the escape directive {m.group(2)!r} is not supported")
            if stripped:
                continue
            directives_open = False
            continue
        directives_open = False
        parts = [stripped]
        while parts[-1].endswith("\\"):
            parts[-1] = parts[-1][:-1]
            while i < len(lines) and (not lines[i].strip() or lines[i].strip().startswith("#")):
                i += 1  # comments and blank lines inside a continuation are dropped; it goes on
            if i >= len(lines):
                break
            parts.append(lines[i].strip())
            i += 1
        joined = " ".join(p.strip() for p in parts if p.strip())
        word, _, rest = joined.partition(" ")
        if word.upper() in ("RUN", "COPY", "ADD") and _HEREDOC.search(rest):
            raise DockerfileError(f"{name}:{start}: {word.upper()} with a here-document is not supported")
        yield start, word.upper(), rest


__all__ = ["BOOKWORM_PYTHON", "Base", "Dockerfile", "DockerfileError", "Step", "load_dockerfile", "map_base",
           "parse_dockerfile"]
