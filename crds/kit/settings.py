"""Every `ROLLOUTD_*` environment variable rolloutd reads, in one table, and the typed settings object of each
process that reads them.

Where it sits: the bottom layer, beside the node's launch contract (`nodeenv.py`, whose names it lists). Each
row says the variable's name, type, default, which processes read it and what it does; the docs' variable
reference (docs/content/reference/environment.md) is generated from it by `crds/kit/reference.py` (`rolloutd crd`).
Each process reads its variables once, at its entry point, into one frozen object whose fields are the rows'
`field`s: `ControllerSettings` (`rolloutd controller`/`operator`), `SandboxSettings` (the node daemon builds it
and hands it to its sandbox runtime; `rolloutd sandbox`/`image` build their own), the node's `nodeenv.NodeEnv`
and the client's `controller/client/connection.ClientSettings`. Parsing and defaults live here; a bad value is a
`SettingsError` naming the variable. Nothing below an entry point reads a `ROLLOUTD_*` variable
(tests/crds/kit/test_settings.py). The next step: `paths.py` (the directories several variables choose).
"""
from __future__ import annotations

import ipaddress
import os
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from .. import nodeenv
from ..errors import ConfigurationError

CONTROLLER, NODE, SANDBOX, CLIENT = "controller", "node", "sandbox", "client"
SET_BY_ROLLOUTD = "set by rolloutd"  # the default of a variable rolloutd sets for others rather than reads


class SettingsError(ConfigurationError, ValueError):
    """A `ROLLOUTD_*` variable holds a value of the wrong kind (the message names it)."""


@dataclass(frozen=True)
class Variable:
    name: str
    type: str                 # how its value is read: path, paths, url, int, number, networks, name, secret, text
    default: str              # the default, in words
    processes: tuple[str, ...]  # who reads it: controller, node, sandbox (the node's sandbox runtime), client
    doc: str

    @property
    def field(self) -> str:
        """The settings objects' field holding it ("" for a variable rolloutd sets rather than reads)."""
        return "" if self.default == SET_BY_ROLLOUTD else self.name.removeprefix("ROLLOUTD_").lower()


VARIABLES: tuple[Variable, ...] = (
    Variable("ROLLOUTD_HOME", "path", "`~/.cache/rolloutd`", (CONTROLLER, SANDBOX),
             "what every clone on a machine shares: the engine venv, built models (`models/`), images (`images/`); "
             "`rolloutd serve-model` (the engine and its models) reads it too"),
    Variable("ROLLOUTD_DATA_DIR", "path", "`$XDG_DATA_HOME/rolloutd` (`~/.local/share/rolloutd`)",
             (CONTROLLER, CLIENT, SANDBOX), "the controller's data directory: database, tokens, certificate, logs; "
             "the sandbox hides it"),
    Variable("ROLLOUTD_STORE", "url", "the data dir's SQLite file `rolloutd.db`", (CONTROLLER,),
             "where the controller keeps jobs, rollouts and trajectories: an SQLite file's path, or a PostgreSQL "
             "server's `postgresql://user:password@host:5432/database` URL (the `[postgresql]` extra; `--store`)"),
    Variable("ROLLOUTD_IMAGE_DIR", "path", "`$ROLLOUTD_HOME/images`", (SANDBOX,),
             "where built root filesystem images are cached (e.g. a cluster filesystem)"),
    Variable("ROLLOUTD_IMAGE_MAX_MB", "int", "8192", (SANDBOX,), "the most an image build may write, in MB (every "
             "file, directory and link counts at least 4 KiB, so many empty files fill it too)"),
    Variable("ROLLOUTD_BUILD_MEMORY_MB", "int", "4096", (SANDBOX,), "the memory one Dockerfile step of an image build "
             "may hold (its cgroup; RLIMIT_AS of twice this per process); a tenant's build at most its policy's "
             "sandboxMemoryMB"),
    Variable("ROLLOUTD_BUILD_PROCESSES", "int", "512", (SANDBOX,), "the processes one Dockerfile step may run at "
             "once (its cgroup's pids.max); a tenant's build at most its policy's sandboxProcesses"),
    Variable("ROLLOUTD_BUILD_CPUS", "number", "2", (SANDBOX,), "the CPU cores one Dockerfile step may use (its "
             "cgroup's CPU quota); a tenant's build at most its policy's sandboxCpus"),
    Variable("ROLLOUTD_BUILD_STEP_SECONDS", "number", "1800", (SANDBOX,), "how long one Dockerfile step may run; a "
             "tenant's build at most its policy's stageSeconds"),
    Variable("ROLLOUTD_BUILD_SECONDS", "number", "3600", (SANDBOX,), "how long a whole image build may run; a "
             "tenant's build at most its policy's stageSeconds"),
    Variable("ROLLOUTD_SANDBOX_DIR", "path", "`$TMPDIR/rolloutd-sandboxes-<uid>`", (SANDBOX,),
             "where each sandbox's private directory (workspace, control socket) is made"),
    Variable("ROLLOUTD_SANDBOX_UID", "int", "65534 (nobody)", (SANDBOX,),
             "the user sandboxed code runs as when the node daemon is root"),
    Variable("ROLLOUTD_SANDBOX_ID", "name", SET_BY_ROLLOUTD, (SANDBOX,),
             "set inside every sandbox process: how a restarted daemon finds what a sandbox left running"),
    Variable("ROLLOUTD_EGRESS_ALLOW", "networks", "none", (SANDBOX,),
             "comma-separated networks an image build's egress proxy may reach although private (a site mirror)"),
    Variable("ROLLOUTD_INSTRUCTION_FILE", "path", SET_BY_ROLLOUTD, (SANDBOX,),
             "set for a harness agent inside its sandbox: the file holding the task's instruction"),
    Variable(nodeenv.CONTROLLER, "url", "none", (NODE,), nodeenv.TABLE[nodeenv.CONTROLLER][1]),
    Variable(nodeenv.JOB, "name", "none", (NODE,), nodeenv.TABLE[nodeenv.JOB][1]),
    Variable(nodeenv.JOIN_TOKEN, "secret", "none", (NODE,), nodeenv.TABLE[nodeenv.JOIN_TOKEN][1]),
    Variable(nodeenv.DRAIN_SECONDS, "number", f"{nodeenv.DEFAULT_DRAIN_SECONDS:g}", (NODE, CONTROLLER),
             nodeenv.TABLE[nodeenv.DRAIN_SECONDS][1]),
    Variable(nodeenv.CONTROLLER_START_SECONDS, "number", f"{nodeenv.DEFAULT_CONTROLLER_START_SECONDS:g}", (NODE,),
             nodeenv.TABLE[nodeenv.CONTROLLER_START_SECONDS][1]),
    Variable(nodeenv.CA_FILE, "path", "the system's CAs", (NODE, CLIENT),
             "CA bundle that signed an https controller's certificate"),
    Variable(nodeenv.TRACING, "text", "unset (off)", (NODE, CONTROLLER),
             "`1` turns on OpenTelemetry traces, one per rollout attempt, exported over OTLP/HTTP; the standard "
             "`OTEL_*` variables (endpoint, headers, service name, sampler) say where and how"),
    Variable(nodeenv.ADMIN_TOKEN, "secret", "none", (CLIENT,),
             "the API token `rolloutctl` and the client send; removed before a node daemon starts"),
    Variable("ROLLOUTD_TOKEN_FILE", "path", "the data directory's `token`", (CLIENT,), "a file holding the API token"),
    Variable("ROLLOUTD_SERVER", "url", "`http://127.0.0.1:7350`", (CLIENT,), "the controller `rolloutctl` and the "
             "client talk to"),
    Variable("ROLLOUTD_NAMESPACE", "name", "`default`", (CLIENT,), "the namespace `rolloutctl` and the client use"),
    Variable("ROLLOUTD_JOB", "name", "none", (CLIENT,), "the job a trainer's adapter (verl's agent loop and "
             "checkpoint manager) trains from, where its config names none"),
    Variable("ROLLOUTD_CONFIG", "path", "`~/.config/rolloutd/config.yaml`", (CLIENT,),
             "the client's config file (server, namespace, token, CA)"),
    Variable("ROLLOUTD_ADVERTISE_URL", "url", "this host's name and the controller's port", (CONTROLLER,),
             "the controller URL node daemons on other hosts use"),
    Variable("ROLLOUTD_REPLICAS", "text", "none (one controller, no leader election)", (CONTROLLER,),
             "comma-separated URLs of every controller replica on this database, this one's included: set, the "
             "replicas elect one leader (`controller/ha/leadership.py`) and hand the whole list to the node daemons"),
    Variable("ROLLOUTD_LEADER_LEASE_SECONDS", "number", "5", (CONTROLLER,),
             "with ROLLOUTD_REPLICAS: the leader lease; a replica leads within this plus 1 s after the leader dies"),
    Variable("ROLLOUTD_NODE_SHARDS", "text", "on", (CONTROLLER,),
             "with ROLLOUTD_REPLICAS on PostgreSQL: every replica serves the node calls of the nodes it owns "
             "(`controller/ha/shards.py`); `0` (or off): they are forwarded to the leader instead"),
    Variable("ROLLOUTD_BACKEND_ALLOW_NETS", "networks", "none", (CONTROLLER,),
             "comma-separated networks a backend URL may point into although link-local (e.g. 169.254.0.0/16)"),
    Variable("ROLLOUTD_TOKENIZER_ROOTS", "paths", "none (the models directory and the Hugging Face cache always)",
             (CONTROLLER,), "more directories an absolute `llm.tokenizer` may be under (separated like PATH)"),
    Variable("ROLLOUTD_MAX_EPISODES_PER_BACKEND", "int", "the backend's own `max_num_seqs`", (CONTROLLER,),
             "the controller-wide default of `llm.maxEpisodesPerBackend`"),
    Variable("ROLLOUTD_BACKEND_TOKENS", "int", "the engine's KV cache (`num_gpu_blocks × block_size`), else 65536",
             (CONTROLLER,), "a backend's tokens in flight (prompt + `max_tokens` of each call): when it is full, "
             "each job with episodes on it is held to its `spec.priority` part; a job alone on a backend has no cap"),
    Variable("ROLLOUTD_NODE_CALLS_PER_SECOND", "number", "250", (CONTROLLER,),
             "the beats a second all node daemons send together to one controller: each daemon beats every "
             "(active nodes ÷ this) seconds on average, its results riding on its beats; with replicas, each "
             "paces the nodes it serves to its own budget (N replicas take up to N times this)"),
    Variable("ROLLOUTD_RESULT_RETENTION_SECONDS", "number", "604800 (7 days)", (CONTROLLER,),
             "how long a deleted job's trajectories stay readable (from its last result) before they are purged"),
    Variable("ROLLOUTD_STALLED_AFTER_SECONDS", "number", "300", (CONTROLLER,),
             "a rollout in one stage (or unnamed by its node's beats) this long is stalled: flagged in the in-flight "
             "view and counted in rolloutd_rollout_stalls_total"),
    Variable("ROLLOUTD_TRACE_URL", "url", "unset (no trace links)", (CONTROLLER,),
             "the web UI's link to a rollout's trace in your OTLP backend's UI, `{trace_id}` replaced by its 32 hex "
             "digits (Jaeger: `http://jaeger:16686/trace/{trace_id}`; with ROLLOUTD_TRACING=1)"),
    Variable("ROLLOUTD_MAX_CONNECTIONS", "int", "its file-descriptor limit less a quarter (at least 256 kept)",
             (CONTROLLER,), "client connections the controller holds at once; past it, the one that has waited "
             "longest for a request head is closed for the newcomer (one serving a request never is)"),
    Variable("ROLLOUTD_WATCH_HISTORY", "int", "50000", (CONTROLLER,),
             "changes the API server keeps for resuming watches (older resource versions answer 410)"),
    Variable("ROLLOUTD_STALL_SAMPLES", "path", "unset (off)", (CONTROLLER,),
             "a diagnostic: the file where the controller reports what its event loop ran while it stalled > 20 ms "
             "(stacks sampled by a watchdog thread, `controller/health/stalls.py`; `bench scale` sets it) and whose "
             "CPU each stall was: the loop's own work, other threads', or none (the process was not given a core)"),
    Variable("ROLLOUTD_K8S_NAMESPACE", "name", "the controller pod's own namespace", (CONTROLLER,),
             "the Kubernetes executor's namespace for node pods"),
    Variable("ROLLOUTD_K8S_NODE_IMAGE", "name", "none", (CONTROLLER,), "the Kubernetes executor's node pod image"),
)
BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}
Networks = tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]


def env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of table variable `name` (None when unset or empty); a name outside the table is a `KeyError`.
    Called only by the settings objects' `from_env` constructors below (and `home_dir`)."""
    if name not in BY_NAME:
        raise KeyError(f"{name} is not in rolloutd's variable table (crds/kit/settings.py)")
    value = (os.environ if environ is None else environ).get(name) or None
    return value if value is None or value.strip() else None


def parse(name: str, raw: str) -> Any:
    """`raw`, the value of variable `name`, read by its row's type (SettingsError naming the variable)."""
    kind = BY_NAME[name].type
    try:
        if kind == "path":
            return Path(raw.strip())
        if kind == "paths":
            return tuple(Path(p.strip()) for p in raw.split(os.pathsep) if p.strip())
        if kind == "int":
            return int(raw.strip())
        if kind == "number":
            return float(raw.strip())
        if kind == "networks":
            return tuple(ipaddress.ip_network(n.strip(), strict=False) for n in raw.split(",") if n.strip())
    except ValueError as e:
        what = {"int": "a whole number", "number": "a number", "networks": "comma-separated networks (10.0.0.0/8)"}
        raise SettingsError(f"{name}={raw!r}: expected {what.get(kind, kind)}"
                            + (f" ({e})" if kind == "networks" else "")) from None
    return raw.strip() if kind in ("url", "name") else raw


def at_least(name: str, value: float | None, least: float) -> None:
    if value is not None and value < least:
        raise SettingsError(f"{name}={value!r}: expected at least {least:g}")


def read(cls: type, process: str, environ: Mapping[str, str] | None) -> dict[str, Any]:
    """The set variables of `process` that are fields of `cls`, parsed: the keyword arguments of its constructor."""
    names = {f.name for f in fields(cls)}
    out = {}
    for v in VARIABLES:
        if process in v.processes and v.field in names and (raw := env(v.name, environ)) is not None:
            out[v.field] = parse(v.name, raw)
    return out


def home_dir(environ: Mapping[str, str] | None = None) -> Path:
    """`$ROLLOUTD_HOME`, default `~/.cache/rolloutd`: shared by every clone on the machine (`rolloutd serve-model`
    reads it here, through `paths.rolloutd_home`; the controller and the sandbox take it from their settings)."""
    raw = env("ROLLOUTD_HOME", environ)
    return parse("ROLLOUTD_HOME", raw) if raw else Path.home() / ".cache" / "rolloutd"


def xdg_data_dir(home: Path | None = None) -> Path:
    """`$XDG_DATA_HOME/rolloutd`, else `<home>/.local/share/rolloutd`: the data directory's default."""
    return Path(os.environ.get("XDG_DATA_HOME") or (home or Path.home()) / ".local" / "share") / "rolloutd"


def _home() -> Path:
    return Path.home() / ".cache" / "rolloutd"


def _sandbox_data_dir() -> Path:
    """The data directory's default as the sandbox hides it (a node user without a home: a path that is none)."""
    try:
        return xdg_data_dir()
    except (KeyError, RuntimeError):
        return xdg_data_dir(Path("/nonexistent"))


@dataclass(frozen=True)
class ControllerSettings:
    """The controller's variables, read once by `rolloutd controller`/`operator` and passed to the store, the
    scheduler, the node registry, the executors and the allow-list checks."""

    home: Path = field(default_factory=_home)
    data_dir: Path = field(default_factory=xdg_data_dir)
    store: str | None = None  # ROLLOUTD_STORE: an SQLite path or a postgresql:// URL (None: the data dir's file)
    drain_seconds: float = nodeenv.DEFAULT_DRAIN_SECONDS
    advertise_url: str | None = None
    replicas: str | None = None
    leader_lease_seconds: float = 5.0
    node_shards: str | None = None  # unset or "1": node shards (`controller/ha/shards.py`; replicas on PostgreSQL only)
    backend_allow_nets: Networks = ()
    tokenizer_roots: tuple[Path, ...] = ()
    max_episodes_per_backend: int | None = None
    backend_tokens: int | None = None
    node_calls_per_second: float = 250.0  # crds/node.py NODE_CALLS_PER_SECOND
    watch_history: int = 50000
    max_connections: int | None = None  # controller/http/connection_budget.py budget_for
    stalled_after_seconds: float = 300.0  # controller/work/held_leases.py HeldLeases.stall_seconds
    result_retention_seconds: float = 604800.0  # controller/work/retention.py DEFAULT_RETENTION_SECONDS
    trace_url: str | None = None  # the web UI's trace links (`ui/links.py`)
    stall_samples: Path | None = None
    tracing: str | None = None   # ROLLOUTD_TRACING (`nodeenv.tracing_on` reads it)
    k8s_namespace: str | None = None
    k8s_node_image: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ControllerSettings":
        values = read(cls, CONTROLLER, environ)
        if "drain_seconds" in values:
            values["drain_seconds"] = max(values["drain_seconds"], 0.0)
        at_least("ROLLOUTD_MAX_EPISODES_PER_BACKEND", values.get("max_episodes_per_backend"), 1)
        at_least("ROLLOUTD_BACKEND_TOKENS", values.get("backend_tokens"), 1)
        at_least("ROLLOUTD_NODE_CALLS_PER_SECOND", values.get("node_calls_per_second"), 0)
        at_least("ROLLOUTD_WATCH_HISTORY", values.get("watch_history"), 1)
        at_least("ROLLOUTD_MAX_CONNECTIONS", values.get("max_connections"), 16)
        at_least("ROLLOUTD_STALLED_AFTER_SECONDS", values.get("stalled_after_seconds"), 0)
        if "trace_url" in values and ("{trace_id}" not in values["trace_url"]
                                      or not values["trace_url"].startswith(("http://", "https://"))):
            raise SettingsError("ROLLOUTD_TRACE_URL: an http(s) URL holding {trace_id}, got "
                                f"{values['trace_url']!r}")
        if "advertise_url" in values:
            values["advertise_url"] = values["advertise_url"].rstrip("/")
        return cls(**values)


@dataclass(frozen=True)
class SandboxSettings:
    """The sandbox runtime's variables on a node, read once by the node daemon (or `rolloutd sandbox`/`image`)
    and handed to the runtime: where sandboxes and images live, who sandboxed code runs as, what it hides."""

    home: Path = field(default_factory=_home)
    data_dir: Path = field(default_factory=_sandbox_data_dir)
    image_dir: Path | None = None  # None: `home`/images
    image_max_mb: int = 8192
    build_memory_mb: int = 4096
    build_processes: int = 512
    build_cpus: float = 2.0
    build_step_seconds: float = 1800.0
    build_seconds: float = 3600.0
    sandbox_dir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()) / f"rolloutd-sandboxes-{os.getuid()}")
    sandbox_uid: int = 65534  # nobody
    egress_allow: Networks = ()

    @property
    def images(self) -> Path:
        """Where built root filesystem images are cached."""
        return self.image_dir or self.home / "images"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SandboxSettings":
        values = read(cls, SANDBOX, environ)
        at_least("ROLLOUTD_IMAGE_MAX_MB", values.get("image_max_mb"), 1)
        at_least("ROLLOUTD_BUILD_MEMORY_MB", values.get("build_memory_mb"), 16)
        at_least("ROLLOUTD_BUILD_PROCESSES", values.get("build_processes"), 8)
        at_least("ROLLOUTD_BUILD_CPUS", values.get("build_cpus"), 0.01)
        at_least("ROLLOUTD_BUILD_STEP_SECONDS", values.get("build_step_seconds"), 1)
        at_least("ROLLOUTD_BUILD_SECONDS", values.get("build_seconds"), 1)
        at_least("ROLLOUTD_SANDBOX_UID", values.get("sandbox_uid"), 0)
        return cls(**values)


def reference_page() -> str:
    """The docs' variable reference, generated from `VARIABLES`."""
    out = ["# Environment variables", "",
           "Every `ROLLOUTD_*` variable rolloutd reads, generated from its table (`rolloutd crd` rewrites this page). "
           "*Read by*: the controller, a node daemon, the sandbox runtime on a node, or the trainer client and "
           "`rolloutctl`.", "",
           "Each variable is read once, when its process starts (the client: when it is made, `rolloutctl`: for each "
           "command), into that process's settings; a change takes effect at the next start. A value of the wrong "
           "kind stops the start with a message naming the variable. An empty value counts as unset.", "",
           "| variable | type | default | read by | what it does |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        out.append(f"| `{v.name}` | {v.type} | {v.default} | {', '.join(v.processes)} | {v.doc.replace('|', '/')} |")
    return "\n".join(out) + "\n"
