"""The client `rolloutctl` uses: the trainer client (`rolloutd.client`) under the names the CLI
knows. Connection resolution, typed errors, watch and trajectory streaming (resumed after a
drop) live there, once, for the CLI, trainers and tests alike.

Resolution: flags, then `ROLLOUTD_SERVER` / `ROLLOUTD_TOKEN` / `ROLLOUTD_TOKEN_FILE`, then the
config file (`$ROLLOUTD_CONFIG` or `~/.config/rolloutd/config.yaml`: `server`, `token`,
`tokenFile`), then the defaults of a local controller (`http://127.0.0.1:7350`, token in its
default data dir).
"""
from __future__ import annotations

from rolloutd.client.core import Connection, RolloutdError, config_path, parse_sse, resolve
from rolloutd.client.sync import RolloutClient

# A failure the CLI reports as one clear line (and exit code 1); `.status` is the server's Status.
ClientError = RolloutdError


class ApiClient(RolloutClient):
    def __init__(self, conn: Connection, timeout: float = 30.0):
        super().__init__(connection=conn, timeout=timeout)


__all__ = ["ApiClient", "ClientError", "Connection", "config_path", "parse_sse", "resolve"]
