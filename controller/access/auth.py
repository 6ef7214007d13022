"""Bearer-token auth for the controller API: the admin token and scoped tokens (node credentials: `nodeauth.py`).

`ensure_token(path)` runs at controller start for the admin token file (`crds/paths.DataDir`): it creates
each (0600, random) once and reuses it afterwards. Scoped tokens (read-only, limited to namespaces) are
files in `DataDir.tokens`, written by `rolloutd token create` and looked up by `TokenBook`; what a scoped
token may do is `access.py`'s call. The API middleware (`middleware.py`) compares tokens in constant time.
"""
from __future__ import annotations

import hmac
import json
import logging
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from rolloutd.crds.rolloutjob import validate_name

log = logging.getLogger("rolloutd.auth")
_TOKEN_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def ensure_token(path: Path, *, mint: bool = True) -> str:
    """The token in `path`, created (random, 0600) on first use; its directory is made 0700 (the API
    token: full access). Node daemons never get it: each job has its own node credential (`nodeauth.py`).
    `mint` False (the data dir already holds a store): a missing or empty file is an error, never a new token that
    would lock every client out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if path.exists():
        os.chmod(path, 0o600)
        token = path.read_text().strip()
        if token:
            return token
    if not mint:
        raise SystemExit(f"the admin token file {path} is missing or empty, but the data dir holds a store: every "
                         "client holds the old token. Restore the file from a backup (or write the token your "
                         "clients use into it), then start again")
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
        f.flush()
        os.fsync(f.fileno())  # on the disk before any client holds it: a crash or an fs error left it empty (#37)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # ... and its name too
    finally:
        os.close(dir_fd)
    return token


def token_matches(header: str | None, token: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())


@dataclass(frozen=True)
class ScopedToken:
    """A token less than the admin's: `read_only` (get, list, watch) and/or limited to `namespaces` (empty: all)."""

    name: str
    token: str
    read_only: bool = False
    namespaces: tuple[str, ...] = ()

    def wire(self) -> dict[str, object]:
        return {"name": self.name, "token": self.token, "readOnly": self.read_only, "namespaces": list(self.namespaces)}


def create_scoped_token(tokens_dir: Path, name: str, *, read_only: bool, namespaces: list[str]) -> ScopedToken:
    """A new random token, written to `tokens_dir/<name>.json` (0600; the directory 0700). The running
    controller picks it up on the next request it sees from it; deleting the file revokes it."""
    if not _TOKEN_NAME.fullmatch(name):
        raise ValueError(f"token name {name!r}: use lowercase letters, digits and '-' (at most 63)")
    for ns in namespaces:
        validate_name(ns)
    scoped = ScopedToken(name, secrets.token_urlsafe(32), read_only, tuple(dict.fromkeys(namespaces)))
    tokens_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(tokens_dir, 0o700)
    fd = os.open(tokens_dir / f"{name}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(scoped.wire(), f)
    return scoped


class TokenBook:
    """The scoped tokens of `tokens_dir` (one JSON file each), read again whenever a file's content changed.

    Every lookup reads the files (a few small ones): a token file narrowed in place keeps its size and even its
    mtime can be set back, so neither the directory's nor the file's mtime says it changed; its bytes do."""

    def __init__(self, tokens_dir: Path | None):
        self.dir = tokens_dir
        self._seen: tuple[tuple[str, bytes], ...] | None = None
        self._tokens: tuple[ScopedToken, ...] = ()

    def find(self, header: str | None) -> ScopedToken | None:
        if self.dir is None or not header:
            return None
        self._refresh()
        return next((t for t in self._tokens if token_matches(header, t.token)), None)

    def _read(self) -> tuple[tuple[str, bytes], ...]:
        out = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                out.append((path.name, path.read_bytes()))
            except OSError as e:  # gone between the listing and the read, or unreadable: it grants nothing
                log.error("ignoring token file %s: %s", path, e.strerror)
        return tuple(out)

    def _refresh(self) -> None:
        try:
            seen = self._read()
        except OSError:
            self._seen, self._tokens = None, ()
            return
        if seen == self._seen:
            return
        tokens = []
        for name, raw in seen:
            try:
                doc = json.loads(raw)
                tokens.append(ScopedToken(str(doc["name"]), str(doc["token"]), bool(doc.get("readOnly")),
                                          tuple(str(n) for n in doc.get("namespaces") or ())))
            except (ValueError, KeyError, TypeError, AttributeError) as e:  # a bad file grants nothing
                log.error("ignoring token file %s: %s", name, type(e).__name__)
        self._seen, self._tokens = seen, tuple(t for t in tokens if t.token)
