"""Every `ROLLOUTD_*` environment variable rolloutd reads, in one table, and the one way to read them.

Where it sits: the bottom layer, beside the node's launch contract (`nodeenv.py`, whose names it lists). Each
row says the variable's name, type, default, which processes read it and what it does; the docs' variable
reference (docs/content/reference/environment.md) is generated from it by `crds/reference.py` (`rolloutd crd`),
and tests/crds/test_settings.py fails when product code names a `ROLLOUTD_*` variable the table lacks.
Product code reads a variable through `env(name)` (a name outside the table raises `KeyError`), when it needs
it — never at import time. The node daemon's own launch variables are read once, into `nodeenv.NodeEnv`, by
agents/daemon/options.py. The next step: `paths.py` (the directories several variables choose).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from . import nodeenv

CONTROLLER, NODE, SANDBOX, CLIENT = "controller", "node", "sandbox", "client"


@dataclass(frozen=True)
class Variable:
    name: str
    type: str                 # how its value is read: path, paths, url, int, number, networks, name, secret, text
    default: str              # the default, in words
    processes: tuple[str, ...]  # who reads it: controller, node, sandbox (the node's sandbox runtime), client
    doc: str


VARIABLES: tuple[Variable, ...] = (
    Variable("ROLLOUTD_HOME", "path", "`~/.cache/rolloutd`", (CONTROLLER, NODE, SANDBOX),
             "what every clone on a machine shares: the engine venv, built models (`models/`), images (`images/`)"),
    Variable("ROLLOUTD_DATA_DIR", "path", "`$XDG_DATA_HOME/rolloutd` (`~/.local/share/rolloutd`)",
             (CONTROLLER, CLIENT, SANDBOX), "the controller's data directory: database, tokens, certificate, logs; "
             "the sandbox hides it"),
    Variable("ROLLOUTD_IMAGE_DIR", "path", "`$ROLLOUTD_HOME/images`", (SANDBOX,),
             "where built root filesystem images are cached (e.g. a cluster filesystem)"),
    Variable("ROLLOUTD_IMAGE_MAX_MB", "int", "8192", (SANDBOX,), "the most an image build may write, in MB"),
    Variable("ROLLOUTD_SANDBOX_DIR", "path", "`$TMPDIR/rolloutd-sandboxes-<uid>`", (SANDBOX,),
             "where each sandbox's private directory (workspace, control socket) is made"),
    Variable("ROLLOUTD_SANDBOX_UID", "int", "65534 (nobody)", (SANDBOX,),
             "the user sandboxed code runs as when the node daemon is root"),
    Variable("ROLLOUTD_SANDBOX_ID", "name", "set by rolloutd", (SANDBOX,),
             "set inside every sandbox process: how a restarted daemon finds what a sandbox left running"),
    Variable("ROLLOUTD_EGRESS_ALLOW", "networks", "none", (SANDBOX,),
             "comma-separated networks an image build's egress proxy may reach although private (a site mirror)"),
    Variable("ROLLOUTD_INSTRUCTION_FILE", "path", "set by rolloutd", (SANDBOX,),
             "set for a harness agent inside its sandbox: the file holding the task's instruction"),
    Variable(nodeenv.CONTROLLER, "url", "none", (NODE,), nodeenv.TABLE[nodeenv.CONTROLLER][1]),
    Variable(nodeenv.JOB, "name", "none", (NODE,), nodeenv.TABLE[nodeenv.JOB][1]),
    Variable(nodeenv.JOIN_TOKEN, "secret", "none", (NODE,), nodeenv.TABLE[nodeenv.JOIN_TOKEN][1]),
    Variable(nodeenv.DRAIN_SECONDS, "number", f"{nodeenv.DEFAULT_DRAIN_SECONDS:g}", (NODE, CONTROLLER),
             nodeenv.TABLE[nodeenv.DRAIN_SECONDS][1]),
    Variable(nodeenv.CA_FILE, "path", "the system's CAs", (NODE, CLIENT),
             "CA bundle that signed an https controller's certificate"),
    Variable(nodeenv.ADMIN_TOKEN, "secret", "none", (CLIENT,),
             "the API token `rolloutctl` and the client send; removed before a node daemon starts"),
    Variable("ROLLOUTD_TOKEN_FILE", "path", "the data directory's `token`", (CLIENT,), "a file holding the API token"),
    Variable("ROLLOUTD_SERVER", "url", "`http://127.0.0.1:7350`", (CLIENT,), "the controller `rolloutctl` and the "
             "client talk to"),
    Variable("ROLLOUTD_NAMESPACE", "name", "`default`", (CLIENT,), "the namespace `rolloutctl` and the client use"),
    Variable("ROLLOUTD_CONFIG", "path", "`~/.config/rolloutd/config.yaml`", (CLIENT,),
             "the client's config file (server, namespace, token, CA)"),
    Variable("ROLLOUTD_ADVERTISE_URL", "url", "this host's name and the controller's port", (CONTROLLER,),
             "the controller URL node daemons on other hosts use"),
    Variable("ROLLOUTD_BACKEND_ALLOW_NETS", "networks", "none", (CONTROLLER,),
             "comma-separated networks a backend URL may point into although link-local (e.g. 169.254.0.0/16)"),
    Variable("ROLLOUTD_TOKENIZER_ROOTS", "paths", "none (the models directory and the Hugging Face cache always)",
             (CONTROLLER,), "more directories an absolute `llm.tokenizer` may be under (separated like PATH)"),
    Variable("ROLLOUTD_MAX_EPISODES_PER_BACKEND", "int", "the backend's own `max_num_seqs`", (CONTROLLER,),
             "the controller-wide default of `llm.maxEpisodesPerBackend`"),
    Variable("ROLLOUTD_NODE_CALLS_PER_SECOND", "number", "250", (CONTROLLER,),
             "how many node protocol calls a second the controller takes before answering 429"),
    Variable("ROLLOUTD_WATCH_HISTORY", "int", "50000", (CONTROLLER,),
             "changes the API server keeps for resuming watches (older resource versions answer 410)"),
    Variable("ROLLOUTD_K8S_NAMESPACE", "name", "the controller pod's own namespace", (CONTROLLER,),
             "the Kubernetes executor's namespace for node pods"),
    Variable("ROLLOUTD_K8S_NODE_IMAGE", "name", "none", (CONTROLLER,), "the Kubernetes executor's node pod image"),
    Variable("ROLLOUTD_SLURM_DIR", "path", "`/tmp/rolloutd-slurm`", (CONTROLLER,),
             "where `python -m rolloutd.controller.sim.minicluster` keeps a one-machine Slurm cluster's files"),
)
BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}


def env(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The value of table variable `name` (None when unset or empty); a name outside the table is a `KeyError`."""
    if name not in BY_NAME:
        raise KeyError(f"{name} is not in rolloutd's variable table (crds/settings.py)")
    return (os.environ if environ is None else environ).get(name) or None


def reference_page() -> str:
    """The docs' variable reference, generated from `VARIABLES`."""
    out = ["# Environment variables", "",
           "Every `ROLLOUTD_*` variable rolloutd reads, generated from its table (`rolloutd crd` rewrites this page). "
           "*Read by*: the controller, a node daemon, the sandbox runtime on a node, or the trainer client and "
           "`rolloutctl`.", "", "| variable | type | default | read by | what it does |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        out.append(f"| `{v.name}` | {v.type} | {v.default} | {', '.join(v.processes)} | {v.doc.replace('|', '/')} |")
    return "\n".join(out) + "\n"
