"""`rolloutctl`'s typer app: the user's CLI, kubectl-shaped (every call but `--version` and the plain `get`).

    rolloutctl apply -f FILE|-                     create or update (prints created/configured/unchanged)
    rolloutctl get rolloutjobs [NAME] [-l SEL] [-o wide|yaml|json]
    rolloutctl describe rolloutjob NAME
    rolloutctl delete rolloutjob NAME [--wait] [--export F.jsonl] [--purge]   results kept unless --purge
    rolloutctl wait rolloutjob NAME --for=condition=Complete --timeout=600s
    rolloutctl watch rolloutjob NAME               live per-stage progress
    rolloutctl trajectories NAME [-o jsonl] [-f]   results (JSON lines), resumable with --cursor
    rolloutctl trajectory NAME SEQ                 one, decoded with the job's tokenizer (trajectory.py)
    rolloutctl logs NAME [--node K] [-f]           the node daemons' logs (logs.py)
    rolloutctl inflight NAME [--stalled-after S]   the rollouts in flight, stalled ones marked (inflight.py)
    rolloutctl backends list|add|remove NAME [URL] the job's LLM backends, while it runs (backends.py)
    rolloutctl policy get|apply -f|delete          the admin's TenantPolicies (`policy.py`)

`-n/--namespace NS` goes before or after the verb, as with kubectl.

Talks to the controller through the trainer client (`rolloutd.client.RolloutClient`); what it
prints is built in `views.py`, the `-f` files are read by `files.py`, `wait`'s waits are `waits.py`'s.
Exit codes: 0 success, 1 error (from the server or the connection), 2 usage error, 3 `wait` timed out.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from rolloutd.client import ClientError, NotFound, RolloutClient, resolve

from . import views
from ..cli_common import TYPER_SETTINGS, NamespaceAnywhere, reader_gone, version_option
from .backends import register as register_backends
from .files import read_documents
from .follow import export_jsonl, follow_job
from .inflight import register as register_inflight
from .logs import register as register_logs
from .results import register as register_results
from .policy import bind as bind_policy
from .trajectory import register as register_trajectory
from .waits import wait_for

app = typer.Typer(
    cls=NamespaceAnywhere,
    help="rolloutctl: declare RolloutJobs and follow them (kubectl-style).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    **TYPER_SETTINGS,
)
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 250)
err = Console(stderr=True, highlight=False, soft_wrap=True)
# `watch`, `wait`, `trajectories -f`, `delete --wait`: a controller restart is ridden through for this long
FOLLOW_RETRY_SECONDS = 300.0
register_trajectory(app, lambda: _client(), lambda fn: _run(fn))  # `rolloutctl trajectory` (both defined below)
register_logs(app, lambda: _client(), lambda fn: _run(fn))  # `rolloutctl logs`
register_inflight(app, lambda: _client(), lambda fn: _run(fn))  # `rolloutctl inflight`
register_backends(app, lambda: _client(), lambda fn: _run(fn))  # `rolloutctl backends list|add|remove`
register_results(app, lambda retry: _client(retry), lambda fn: _run(fn), lambda m, c=1: _fail(m, c),
                 FOLLOW_RETRY_SECONDS)  # `rolloutctl trajectories`
_RESOURCE = {"rolloutjob", "rolloutjobs", "rj", "rolloutjob.rolloutd.io", "rolloutjobs.rolloutd.io"}


class _State:
    server: str | None = None
    token_file: Path | None = None
    namespace: str | None = None
    ca_file: Path | None = None


@app.callback()
def _global(
    server: Optional[str] = typer.Option(None, "--server", envvar="ROLLOUTD_SERVER", help="controller URL"),
    token_file: Optional[Path] = typer.Option(None, "--token-file", help="file holding the API token"),
    namespace: Optional[str] = typer.Option(None, "-n", "--namespace", envvar="ROLLOUTD_NAMESPACE",
                                            help="the jobs' namespace (default: the config's, else 'default')"),
    ca_file: Optional[Path] = typer.Option(None, "--certificate-authority",
                                           help="CA bundle of an https controller [default: $ROLLOUTD_CA_FILE, "
                                                "config caFile, else the system's]"),
    _version: bool = version_option(),
) -> None:
    _State.server = server
    _State.token_file = token_file
    _State.namespace = namespace
    _State.ca_file = ca_file


def _client(retry_for: float = 0.0) -> RolloutClient:
    """The client of one command; a one-shot command fails at once when the controller cannot be reached
    (as kubectl), a following one (`retry_for`) waits for a restarted controller."""
    return _run(lambda: RolloutClient(connection=resolve(_State.server, _State.token_file, namespace=_State.namespace,
                                                         ca_file=_State.ca_file), retry_for=retry_for))


def _job_names(incomplete: str) -> list[str]:
    """Shell completion of a job's name: the namespace's jobs that start with what was typed (nothing when the
    controller cannot be reached: a TAB must never hang or print an error)."""
    try:
        client = RolloutClient(connection=resolve(_State.server, _State.token_file, namespace=_State.namespace,
                                                  ca_file=_State.ca_file), timeout=2.0, retry_for=0)
        names = [o["metadata"]["name"] for o in client.list()["items"]]
    except Exception:  # noqa: BLE001 - completion offers nothing rather than fail
        return []
    return sorted(n for n in names if n.startswith(incomplete))


JOB_NAME = {"autocompletion": _job_names}


def _fail(message: str, code: int = 1) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}" if sys.stderr.isatty() else f"error: {message}", markup=sys.stderr.isatty())
    return typer.Exit(code)


def _check_resource(resource: str) -> None:
    if resource.lower() not in _RESOURCE:
        raise _fail(f"unknown resource type {resource!r}; this CLI knows rolloutjobs (aliases: rolloutjob, rj)", 2)


def _run(fn):
    try:
        return fn()
    except ClientError as e:
        causes = e.status.get("details", {}).get("causes", [])
        lines = [str(e)] + [f"  {c.get('field')}: {c.get('message')}" for c in causes if len(causes) > 1]
        raise _fail("\n".join(lines)) from None
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except BrokenPipeError:  # `rolloutctl trajectories … | head`: the reader has what it wanted
        raise reader_gone() from None
    except Exception as e:  # noqa: BLE001 - e.g. a malformed server URL: one line, never a traceback
        raise _fail(f"{type(e).__name__}: {e}") from None


# ---------------------------------------------------------------- apply


@app.command()
def apply(
    filename: str = typer.Option(..., "-f", "--filename", help="YAML/JSON file, or - for stdin"),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="json|yaml: print the stored objects"),
) -> None:
    """Create or update RolloutJobs from a file (server-side apply)."""
    docs = read_documents(filename, _fail)
    client = _client()
    for doc in docs:
        obj, outcome = _run(lambda: client.apply_with_outcome(doc))
        if output in ("json", "yaml"):
            views.print_obj(out, obj, output)
        else:
            print(f"rolloutjob.rolloutd.io/{obj['metadata']['name']} {outcome}")


# ---------------------------------------------------------------- get


@app.command()
def get(
    resource: str = typer.Argument(..., help="rolloutjobs"),
    name: Optional[str] = typer.Argument(None, **JOB_NAME),
    selector: Optional[str] = typer.Option(None, "-l", "--selector", help="label selector, e.g. team=rl,env!=dev"),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="wide|yaml|json"),
    all_namespaces: bool = typer.Option(False, "-A", "--all-namespaces", help="the jobs of every namespace"),
) -> None:
    """List RolloutJobs or show one."""
    _check_resource(resource)
    if output not in (None, "wide", "yaml", "json"):
        raise _fail(f"unknown output format {output!r} (wide, yaml, json)", 2)
    client = _client()
    if name:
        items = [_run(lambda: client.get(name))]
        if output in ("yaml", "json"):
            return views.print_obj(out, items[0], output)
    else:
        listing = _run(lambda: client.list(selector, all_namespaces=all_namespaces))
        if output in ("yaml", "json"):
            return views.print_obj(out, listing, output)
        items = listing["items"]
        if not items:
            err.print("No resources found.")
            return
    print(views.jobs_table(items, wide=output == "wide", namespaces=all_namespaces and not name))


# ---------------------------------------------------------------- describe


@app.command()
def describe(resource: str = typer.Argument(...), name: str = typer.Argument(..., **JOB_NAME)) -> None:
    """Show a RolloutJob: spec summary, status, reward and stage times, conditions and events."""
    _check_resource(resource)
    client = _client()
    obj = _run(lambda: client.get(name))
    print(views.describe_text(obj, _run(lambda: client.events(name)), _run(lambda: _stats(client, name))))


def _stats(client: RolloutClient, name: str) -> dict[str, Any] | None:
    try:
        return client.stats(name)
    except NotFound:  # a controller of an earlier version
        return None


# ---------------------------------------------------------------- delete


@app.command()
def delete(
    resource: str = typer.Argument(...),
    name: Optional[str] = typer.Argument(None, **JOB_NAME),
    selector: Optional[str] = typer.Option(None, "-l", "--selector", help="delete every job with these labels"),
    wait: bool = typer.Option(False, "--wait", help="return only once the job is gone"),
    timeout: str = typer.Option("300s", "--timeout"),
    export: Optional[Path] = typer.Option(None, "--export", help="first write every trajectory to this JSONL file"),
    purge: bool = typer.Option(False, "--purge", help="also remove its results now (else the controller keeps "
                                                      "them for its retention period, 7 days by default)"),
) -> None:
    """Delete RolloutJobs (NAME, or -l SELECTOR): running rollouts are cancelled, then the job is removed. Its
    trajectories stay readable (`rolloutctl trajectories NAME`) for the controller's retention period unless --purge."""
    _check_resource(resource)
    if (name is None) == (selector is None):
        raise _fail("give a job's NAME or -l SELECTOR", 2)
    if export is not None and name is None:
        raise _fail("--export writes one job's trajectories: give its NAME", 2)
    client = _client(FOLLOW_RETRY_SECONDS if wait or purge else 0.0)
    names = [name] if name else [o["metadata"]["name"] for o in _run(lambda: client.list(selector))["items"]]
    if not names:
        err.print("No resources found.")
    for job in names:
        if export is not None:
            n = _run(lambda: export_jsonl(client, job, export))
            print(f"{n} trajectories of rolloutjob/{job} written to {export}")
        if _run(lambda: _delete(client, job, missing_ok=purge)):  # --purge: the job may be gone already
            print(f'rolloutjob.rolloutd.io "{job}" deleted')
    for job in names if wait or purge else ():
        code = wait_for(client, job, "delete", _seconds(timeout), err)
        if code:
            raise typer.Exit(code)
        if purge:
            _run(lambda: client.purge_results(job))
            print(f'results of rolloutjob "{job}" purged')


def _delete(client: RolloutClient, name: str, missing_ok: bool) -> bool:
    try:
        client.delete(name)
    except NotFound:
        if not missing_ok:
            raise
        return False
    return True


# ---------------------------------------------------------------- wait


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)?", text.strip())
    if not m:
        raise _fail(f"invalid duration {text!r} (examples: 30s, 10m, 1h)", 2)
    return float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


@app.command()
def wait(
    resource: str = typer.Argument(...),
    name: str = typer.Argument(..., **JOB_NAME),
    for_: str = typer.Option("condition=Complete", "--for",
                             help="condition=TYPE[=True|False], phase=PHASE, or delete"),
    timeout: str = typer.Option("600s", "--timeout", help="e.g. 30s, 10m"),
) -> None:
    """Block until a condition holds. Exit 0 when met, 1 if the job failed/ended otherwise, 3 on timeout."""
    _check_resource(resource)
    if not (for_ == "delete" or re.fullmatch(r"(condition|phase)=[A-Za-z]+(=(True|False|Unknown))?", for_)):
        raise _fail(f"invalid --for {for_!r}: use condition=Complete, phase=Running or delete", 2)
    client = _client(FOLLOW_RETRY_SECONDS)
    raise typer.Exit(_run(lambda: wait_for(client, name, for_, _seconds(timeout), err)))


# ---------------------------------------------------------------- watch


@app.command()
def watch(
    resource: str = typer.Argument(...),
    name: str = typer.Argument(..., **JOB_NAME),
    timeout: str = typer.Option("24h", "--timeout"),
) -> None:
    """Follow a RolloutJob live (per-stage counts) until it ends; a line per change when stdout is not a terminal."""
    _check_resource(resource)
    client = _client(FOLLOW_RETRY_SECONDS)
    obj = _run(lambda: client.get(name))
    deadline = _seconds(timeout)

    raise typer.Exit(_run(lambda: follow_job(client, obj, deadline, out)))


app.add_typer(bind_policy(_State, _run, _fail, lambda filename: read_documents(filename, _fail, "TenantPolicy")),
              name="policy")  # the admin's TenantPolicies
