"""`rolloutctl get`'s fast path: the plain forms of `get` answered with the standard library's http.client and the
plain-text table, without typer, rich or httpx (each call of a shell loop or a CI step would pay for them).

`entry.py` calls `run`; anything this path does not know (another flag, `--help`, a tty that wants rich's
JSON, an error answer, an unreachable controller) returns None and the full typer app (`app.py`) handles the call
from the start, so flags, errors and exit codes stay exactly the full CLI's.
"""
from __future__ import annotations

import http.client
import json
import os
import ssl
import sys
from typing import Any
from urllib.parse import urlencode, urlsplit

RESOURCES = {"rolloutjob", "rolloutjobs", "rj", "rolloutjob.rolloutd.io", "rolloutjobs.rolloutd.io"}
OUTPUTS = (None, "wide", "yaml", "json")
TIMEOUT = 30.0  # seconds, as the full client's default
# option → its key; every one of these takes a value (`--opt V`, `--opt=V`, and `-xV` for the short ones)
_VALUED = {"--server": "server", "--token-file": "token_file", "-n": "namespace", "--namespace": "namespace",
           "--certificate-authority": "ca_file", "-l": "selector", "--selector": "selector",
           "-o": "output", "--output": "output"}
_GLOBAL = {"server", "token_file", "namespace", "ca_file"}  # the rest only after the verb


def parse(args: list[str]) -> dict[str, Any] | None:
    """`get RESOURCE [NAME] [-l SEL] [-o FMT] [-A]` with the global options before it (`-n` anywhere), as a
    dict of the options; None for any other command line."""
    opts: dict[str, Any] = {"all_namespaces": False}
    positional: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if not eq and len(arg) > 2 and arg[:2] in ("-n", "-l", "-o"):
            flag, eq, value = arg[:2], "=", arg[2:]
        if flag in _VALUED:
            if not eq:
                if i + 1 >= len(args):
                    return None
                i += 1
                value = args[i]
            key = _VALUED[flag]
            if key in _GLOBAL and key != "namespace" and positional:
                return None  # a global option after the verb: typer's error, not ours
            opts[key] = value
        elif arg in ("-A", "--all-namespaces") and positional:
            opts["all_namespaces"] = True
        elif arg.startswith("-") and arg != "-":
            return None
        else:
            positional.append(arg)
        i += 1
    if not 2 <= len(positional) <= 3 or positional[0] != "get" or positional[1].lower() not in RESOURCES:
        return None
    if opts.get("output") not in OUTPUTS or (opts.get("output") == "json" and sys.stdout.isatty()):
        return None  # an unknown format's error, or rich's coloured JSON: the full path
    opts["name"] = positional[2] if len(positional) == 3 else None
    return opts


def fetch(url: str, token: str, ca_file: str | None) -> Any:
    """The JSON of a 200 answer to a GET of `url`, else None (the full path then says why)."""
    parts = urlsplit(url)
    if parts.scheme == "http":
        conn: http.client.HTTPConnection = http.client.HTTPConnection(parts.netloc, timeout=TIMEOUT)
    elif parts.scheme == "https" and ca_file:  # without a CA file httpx trusts certifi's bundle: the full path's call
        conn = http.client.HTTPSConnection(parts.netloc, timeout=TIMEOUT, context=ssl.create_default_context(
            cafile=ca_file))
    else:
        return None
    try:
        conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""),
                     headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
        r = conn.getresponse()
        return json.loads(r.read()) if r.status == 200 else None
    finally:
        conn.close()


def answer(opts: dict[str, Any]) -> tuple[Any, bool] | None:
    """(what the controller answered, whether it is a list), or None when the full path must run."""
    from rolloutd.client.connection import resolve
    from rolloutd.crds.names import API_PREFIX, job_key, job_path

    c = resolve(opts.get("server"), opts.get("token_file"), namespace=opts.get("namespace"),
                ca_file=opts.get("ca_file"))
    if opts["name"]:
        path = job_path(job_key(c.namespace, opts["name"]))
    else:
        params = {} if opts["all_namespaces"] else {"fieldSelector": f"metadata.namespace={c.namespace}"}
        if opts.get("selector"):
            params["labelSelector"] = opts["selector"]
        path = f"{API_PREFIX}/rolloutjobs" + (f"?{urlencode(params)}" if params else "")
    body = fetch(c.server.split(",")[0] + path, c.token, c.ca_file)  # several: the first; the full path fails over
    return None if body is None else (body, not opts["name"])


def show(body: Any, is_list: bool, opts: dict[str, Any]) -> None:
    """Print as `ctl.get` does."""
    output = opts.get("output")
    if output == "json":
        print(json.dumps(body, indent=2))
        return
    if output == "yaml":
        import yaml

        print(yaml.safe_dump(body, sort_keys=False), end="")
        return
    items = body["items"] if is_list else [body]
    if not items:
        print("No resources found.", file=sys.stderr)
        return
    from .table import jobs_table

    print(jobs_table(items, wide=output == "wide", namespaces=opts["all_namespaces"] and is_list))


def run(args: list[str]) -> int | None:
    """The exit code of a `get` answered here, or None: the full CLI takes the call."""
    if os.environ.get("_ROLLOUTCTL_COMPLETE") or (opts := parse(args)) is None:
        return None
    try:
        got = answer(opts)
    except Exception:  # noqa: BLE001 - no token, a malformed URL, a refused connection: the full path says why
        return None
    if got is None:
        return None
    try:
        show(*got, opts)
        sys.stdout.flush()
    except BrokenPipeError:  # `rolloutctl get | head`: as coreutils, quietly with SIGPIPE's status
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
        return 141
    return 0
