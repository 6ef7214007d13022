"""Bearer-token auth for the controller API.

`ensure_token(path)` runs at controller start for the two token files (`config.DataDir`): it creates
each (0600, random) once and reuses it afterwards. The API middleware (`api.py`) compares every
request's `Authorization: Bearer …` with them in constant time. The CLI and clients read the files.
"""
from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path


def ensure_token(path: Path) -> str:
    """The token in `path`, created (random, 0600) on first use; its directory is made 0700.

    Two exist: the API token (full access) and the join token (node daemons: only the node
    protocol), so a compromised node cannot read or change other jobs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if path.exists():
        os.chmod(path, 0o600)
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def token_matches(header: str | None, token: str) -> bool:
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())
