"""Where the controller is and which token to send, resolved once for both clients and `rolloutctl`.

Resolution (first hit wins, per item):
  server: argument, `ROLLOUTD_SERVER`, config `server`, `http://127.0.0.1:7350`;
  namespace: argument, `ROLLOUTD_NAMESPACE`, config `namespace`, `default`;
  CA file (https: the bundle that signed the controller's certificate): argument `ca_file`,
          `ROLLOUTD_CA_FILE`, config `caFile`, else the system's;
  token:  argument `token`, else the file of argument `token_file`, else `ROLLOUTD_TOKEN`,
          config `token`, the file of `ROLLOUTD_TOKEN_FILE` / config `tokenFile`, and finally the
          local controller's token file (`crds.kit.paths.DataDir`).
The config file is `$ROLLOUTD_CONFIG`, else `~/.config/rolloutd/config.yaml`. The variables are the client's
settings object, `ClientSettings`, read once per `resolve` (the client's entry point: each client, each
`rolloutctl` command) unless one is given. The clients (`sync`, `aio`) build their httpx client from `client_options`.
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from rolloutd.crds.kit.settings import CLIENT, SettingsError, read, xdg_data_dir
from rolloutd.crds.kit.paths import DEFAULT_HOST, DEFAULT_PORT, DataDir
from rolloutd.crds.kit.documents import malformed_yaml

from .errors import ClientError


@dataclass(frozen=True)
class ClientSettings:
    """The client's variables (None: unset, the config file or the default decides)."""

    server: str | None = None
    namespace: str | None = None
    job: str | None = None  # a trainer adapter's job (verl's), where its config names none
    token: str | None = None
    token_file: Path | None = None
    ca_file: Path | None = None
    config: Path = field(default_factory=lambda: Path.home() / ".config" / "rolloutd" / "config.yaml")
    data_dir: Path = field(default_factory=xdg_data_dir)  # the local controller's, for its token file

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ClientSettings":
        try:
            return cls(**read(cls, CLIENT, environ))
        except SettingsError as e:
            raise ClientError(str(e)) from None


@dataclass
class Connection:
    server: str
    token: str
    namespace: str = "default"
    ca_file: str | None = None


def _read_config(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    text = path.read_text()
    try:
        import yaml
    except ImportError:  # a trainer image without PyYAML: the file is flat `key: value` lines
        return {k.strip(): v.strip().strip("'\"") for k, _, v in
                (ln.partition(":") for ln in text.splitlines() if ":" in ln and not ln.lstrip().startswith("#"))}
    try:
        cfg = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ClientError(f"config file {path}: {malformed_yaml(e)}") from None
    if not isinstance(cfg, dict):
        raise ClientError(f"config file {path}: expected a mapping (server, token, tokenFile, namespace, caFile)")
    return cfg


def resolve(server: str | None = None, token_file: str | Path | None = None, token: str | None = None,
            namespace: str | None = None, ca_file: str | Path | None = None,
            settings: ClientSettings | None = None) -> Connection:
    """Where the controller is and which bearer token to send (see the module docstring); `settings`: the
    client's variables (read from the environment now when omitted)."""
    env = settings or ClientSettings.from_env()
    path = env.config
    cfg = _read_config(path)
    server = server or env.server or cfg.get("server") or f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
    if not token and not token_file:
        token = env.token or cfg.get("token")
    if not token:
        tf = token_file or env.token_file or cfg.get("tokenFile") or DataDir(env.data_dir).token
        tf = Path(tf).expanduser()
        try:
            token = tf.read_text().strip()
        except OSError as e:
            raise ClientError(
                f"no API token: cannot read {tf} ({e.strerror}); give rolloutctl --token-file FILE (the Python "
                f"client: token_file=), set ROLLOUTD_TOKEN_FILE or ROLLOUTD_TOKEN, or write 'tokenFile:' / 'token:' "
                f"in {path}"
            ) from None
    namespace = namespace or env.namespace or cfg.get("namespace") or "default"
    ca_file = ca_file or env.ca_file or cfg.get("caFile") or None
    return Connection(str(server).rstrip("/"), token, str(namespace), str(Path(ca_file).expanduser()) if ca_file else None)



def addresses(server: str) -> list[str]:
    """The controller addresses in a `server` setting (comma-separated)."""
    return [a.strip().rstrip("/") for a in server.split(",") if a.strip()]


def client_options(conn: Connection, timeout: float, asynchronous: bool = False) -> dict[str, Any]:
    """httpx client keywords; a `server` naming several controllers (comma-separated) gets a transport that moves
    between them (`failover.py`)."""
    # plain http: no TLS to verify, and loading the system's CA bundle costs a command-line call ~30 ms of CPU
    servers = addresses(conn.server)
    verify = trust(conn.ca_file) if any(not s.startswith("http://") for s in servers) else False
    out = {"base_url": servers[0] if servers else conn.server, "timeout": timeout,
           "headers": {"Authorization": f"Bearer {conn.token}"}, "verify": verify}
    if len(servers) > 1:
        from .failover import AsyncFailover, Failover  # httpx: not on rolloutctl's fast path (`controller/ctl/fast.py`)

        out["transport"] = (AsyncFailover if asynchronous else Failover)(servers, verify=verify)
    return out


def trust(ca_file: str | None) -> ssl.SSLContext | bool:
    """httpx's `verify`: the system's CAs, or only the bundle in `ca_file` (ROLLOUTD_CA_FILE / config caFile)."""
    if not ca_file:
        return True
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as e:
        raise ClientError(f"CA file {ca_file} (ROLLOUTD_CA_FILE / config caFile): cannot use it: {e}") from None
