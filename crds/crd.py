"""Generates the Kubernetes CustomResourceDefinitions (`crds/rolloutjob.yaml`, `crds/tenantpolicy.yaml`) from the
pydantic models.

Called by `rolloutd crd` (regenerate) and by the staleness test. Kubernetes wants a
*structural* OpenAPI v3 schema: no `$ref`, no `anyOf` with null (→ `nullable`), and no
`additionalProperties: false` beside `properties` (unknown fields are pruned by the API server).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .rolloutjob import GROUP, KIND, VERSION, RolloutJobSpec, RolloutJobStatus

CRD_PATH = Path(__file__).with_name("rolloutjob.yaml")
# the Helm chart ships the same file (Helm installs what its crds/ folder holds): `rolloutd crd` writes both
CHART_CRD_PATH = Path(__file__).resolve().parents[1] / "charts" / "rolloutd" / "crds" / "rolloutjob.yaml"
PLURAL = "rolloutjobs"
POLICY_CRD_PATH = Path(__file__).with_name("tenantpolicy.yaml")  # the TenantPolicy's, beside it
_DROP = {"title", "$defs", "discriminator"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "additionalProperties" and value is False:
            continue
        if key == "anyOf":
            options = [o for o in value if o.get("type") != "null"]
            if len(options) < len(value):
                out["nullable"] = True
            if len(options) == 1:
                out.update(_structural(options[0], defs))
                continue
            if sorted(o.get("type", "") for o in options) == ["integer", "string"]:
                out["x-kubernetes-int-or-string"] = True
                continue
            out[key] = _structural(options, defs)
            continue
        if key == "prefixItems":  # tuples (e.g. the DAPO band): a plain array with fixed length
            out["items"] = _structural(value[0], defs)
            out["minItems"] = out["maxItems"] = len(value)
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
            continue
        out[key] = _structural(value, defs)
    for bound, exclusive in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        # JSON Schema 2020 (pydantic) gives the bound as a number; OpenAPI v3.0 (an API server) wants the
        # bound in minimum/maximum and exclusive*: true, and refuses the CRD otherwise
        if isinstance(out.get(bound), (int, float)) and not isinstance(out[bound], bool):
            out[exclusive], out[bound] = out[bound], True
    if out.get("type") == "string" and out.get("format") == "date-time":
        out.pop("default", None)
    return out


def _schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


# The job table's columns, for `kubectl get` (here) and `rolloutctl get` (`controller/ctl_views.py`) alike: one
# vocabulary (scored / agent-failed / infra-failed / cancelled, as `StageCounts`); priority 1: `-o wide` only.
PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Nodes", "type": "integer", "jsonPath": ".status.nodes", "description": "node daemons registered"},
    {"name": "Scored", "type": "integer", "jsonPath": ".status.counts.scored"},
    {"name": "Agent-Failed", "type": "integer", "jsonPath": ".status.counts.agentFailed"},
    {"name": "Infra-Failed", "type": "integer", "jsonPath": ".status.counts.infraFailed"},
    {"name": "Total", "type": "integer", "jsonPath": ".status.counts.total"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.rewardMean"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Cancelled", "type": "integer", "jsonPath": ".status.counts.cancelled", "priority": 1},
    {"name": "Requested", "type": "integer", "jsonPath": ".spec.executor.nodes", "priority": 1,
     "description": "nodes asked for"},
    {"name": "Executor", "type": "string", "jsonPath": ".spec.executor.kind", "priority": 1},
    {"name": "Tasks", "type": "string", "jsonPath": ".spec.tasks.kind", "priority": 1},
    {"name": "Message", "type": "string", "jsonPath": ".status.message", "priority": 1},
]


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": "rolloutjob", "shortNames": ["rj"],
                      "categories": ["rolloutd"]},
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": _schema(RolloutJobSpec),
                                "status": _schema(RolloutJobStatus),
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd() -> str:
    header = "# Generated by `rolloutd crd` from rolloutd.crds.rolloutjob - do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def build_policy_crd() -> dict[str, Any]:
    """The TenantPolicy's CRD: its schema for `kubectl explain` and clusters that keep the resource (the
    controller serves and enforces it itself; see crds/tenancy.py)."""
    from .tenancy import POLICY_KIND, POLICY_PLURAL, TenantPolicySpec

    columns = [{"name": "Runtimes", "type": "string", "jsonPath": ".spec.runtimes"},
               {"name": "Jobs", "type": "integer", "jsonPath": ".spec.quotas.jobs"},
               {"name": "Nodes", "type": "integer", "jsonPath": ".spec.quotas.nodes"},
               {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    schema = {"type": "object", "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                               "metadata": {"type": "object"}, "spec": _schema(TenantPolicySpec)}}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{POLICY_PLURAL}.{GROUP}"},
            "spec": {"group": GROUP, "scope": "Cluster",
                     "names": {"kind": POLICY_KIND, "plural": POLICY_PLURAL, "singular": "tenantpolicy",
                               "shortNames": ["tp"], "categories": ["rolloutd"]},
                     "versions": [{"name": VERSION, "served": True, "storage": True,
                                   "additionalPrinterColumns": columns, "schema": {"openAPIV3Schema": schema}}]}}


def render_policy_crd() -> str:
    header = "# Generated by `rolloutd crd` from rolloutd.crds.tenancy - do not edit by hand.\n"
    return header + yaml.safe_dump(build_policy_crd(), sort_keys=False, width=100)


def write_crd(path: Path = CRD_PATH) -> Path:
    path.write_text(render_crd())
    return path
