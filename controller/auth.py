"""Bearer-token auth for the controller API.

`ensure_token(data_dir)` runs at controller start: it creates `DIR/token` (0600, random) once
and reuses it afterwards. The API middleware (`api.py`) compares every request's
`Authorization: Bearer …` with it in constant time. The CLI and clients read the same file.
"""
from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

TOKEN_FILE = "token"


def ensure_token(data_dir: Path, filename: str = TOKEN_FILE) -> str:
    """The token in `data_dir/filename`, created (random, 0600) on first use.

    Two exist: `token` (the API, full access) and `join-token` (node daemons: only the node
    protocol), so a compromised node cannot read or change other jobs."""
    data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir, 0o700)
    path = data_dir / filename
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
