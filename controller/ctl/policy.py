"""`rolloutctl policy get|apply -f|delete`: the admin's TenantPolicies (`crds/tenancy.py`), one per namespace.

    rolloutctl policy get [NAMESPACE] [-o yaml|json]   the stored policies (a namespace without one: restricted)
    rolloutctl policy apply -f FILE|-                  create or replace each TenantPolicy in the file
    rolloutctl policy delete NAMESPACE                 back to the restricted profile

Mounted by `app.py` as the `policy` group (`bind` hands over its options and error helpers); talks to the controller's /apis/rolloutd.io/v1alpha1/tenantpolicies
(admin token only: a namespace token is refused with 403). Next step: `--dry-run`.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import httpx
import typer

from rolloutd.client import ClientError
from rolloutd.crds.names import API_PREFIX

policy_app = typer.Typer(help="The admin's TenantPolicies: what each namespace's jobs may use.", no_args_is_help=True,
                         rich_markup_mode=None)
PATH = f"{API_PREFIX}/tenantpolicies"
_ctl: dict[str, Any] = {}  # rolloutctl's global options (`state`) and helpers (`run`, `fail`, `load`)


def bind(state: Any, run: Callable, fail: Callable, load: Callable) -> typer.Typer:
    """The `policy` group, using rolloutctl's global options and its error and file helpers."""
    _ctl.update(state=state, run=run, fail=fail, load=load)
    return policy_app


def _call(method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    from rolloutd.client.connection import client_options, resolve

    st = _ctl["state"]
    conn = resolve(st.server, st.token_file, ca_file=st.ca_file)
    with httpx.Client(**client_options(conn, 30.0)) as http:
        r = http.request(method, path, json=body)
    try:
        doc = r.json()
    except ValueError:
        doc = {"message": r.text[:300]}
    if r.status_code >= 400:
        raise ClientError(f"{method} {path}: HTTP {r.status_code}: {doc.get('message', '')}", status=doc)
    return doc


@policy_app.command("get")
def get(namespace: str = typer.Argument(None, help="one namespace's policy"),
        output: str = typer.Option("table", "-o", "--output", help="table | yaml | json")) -> None:
    """The stored TenantPolicies (or one namespace's)."""
    doc = _ctl["run"](lambda: _call("GET", f"{PATH}/{namespace}" if namespace else PATH))
    items = [doc] if namespace else doc["items"]
    if output == "json":
        print(json.dumps(doc, indent=2))
    elif output == "yaml":
        import yaml
        print(yaml.safe_dump(doc, sort_keys=False), end="")
    else:
        print(f"{'NAMESPACE':<24} {'RUNTIMES':<16} {'DATA ROOTS':<32} JOBS  NODES")
        for i in items:
            s = i["spec"]
            print(f"{i['metadata']['name']:<24} {','.join(s['runtimes']):<16} {','.join(s['dataRoots']) or '-':<32} "
                  f"{s['quotas']['jobs']:<5} {s['quotas']['nodes']}")


@policy_app.command("apply")
def apply(filename: str = typer.Option(..., "-f", "--filename", help="YAML or JSON file, or - for stdin")) -> None:
    """Create or replace each TenantPolicy in the file."""
    for doc in _ctl["load"](filename):
        name = (doc.get("metadata") or {}).get("name") if isinstance(doc, dict) else None
        if not isinstance(name, str) or not name:
            raise _ctl["fail"]("a TenantPolicy needs metadata.name (the namespace it governs)", 2)
        before = _ctl["run"](lambda: _exists(name))
        _ctl["run"](lambda: _call("PUT", f"{PATH}/{name}", doc))
        print(f"tenantpolicy.rolloutd.io/{name} {'configured' if before else 'created'}")


def _exists(name: str) -> bool:
    try:
        _call("GET", f"{PATH}/{name}")
        return True
    except ClientError as e:
        if e.code == 404:
            return False
        raise


@policy_app.command("delete")
def delete(namespace: str = typer.Argument(..., help="the namespace whose policy goes")) -> None:
    """Delete a namespace's policy: its jobs are held to the restricted profile from then on."""
    _ctl["run"](lambda: _call("DELETE", f"{PATH}/{namespace}"))
    print(f"tenantpolicy.rolloutd.io/{namespace} deleted")
