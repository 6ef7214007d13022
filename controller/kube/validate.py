"""A request's RolloutJob body → a validated resource: apiVersion/kind, name and namespace against the URL,
the controller's policy, `?fieldValidation=Strict|Warn|Ignore` and `?dryRun=All`.

Used by every write route (`rolloutjobs.py`). Unknown fields: 422 naming them by default and with Strict;
dropped with a `Warning` header (Warn) or silently (Ignore), as Kubernetes does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from rolloutd.crds.job_status import RolloutJobStatus
from rolloutd.crds.rolloutjob import API_VERSION, DEFAULT_NAMESPACE, KIND, RolloutJob

from ..errors import BadRequest, Invalid, from_validation_error
from ..access.allowlists import AllowLists, backend_url_problem, tokenizer_problem
from ..spec_checks import check_spec

VALIDATION = ("Strict", "Warn", "Ignore")


@dataclass(frozen=True)
class Checks:
    """What this controller holds a written spec to, beyond its model: its allow-lists (None: the defaults) and the
    executor kinds whose nodes see its files (their tokenizer directories must exist here)."""
    allow: AllowLists | None = None
    shared_filesystem: frozenset[str] = frozenset()


@dataclass
class Options:
    dry_run: bool = False
    field_validation: str = "Strict"
    warnings: list[str] = field(default_factory=list)
    checks: Checks = Checks()


def options(request: Request, checks: Checks = Checks()) -> Options:
    q = request.query_params
    dry = q.getlist("dryRun")
    if any(d != "All" for d in dry):
        raise BadRequest(f"dryRun must be 'All', got {','.join(dry)[:40]!r}",
                         causes=[{"field": "dryRun", "reason": "FieldValueNotSupported", "message": "supported: All"}])
    fv = q.get("fieldValidation") or "Strict"
    if fv not in VALIDATION:
        raise BadRequest(f"fieldValidation must be one of Strict, Warn, Ignore; got {fv[:40]!r}", causes=[
            {"field": "fieldValidation", "reason": "FieldValueNotSupported", "message": "supported: Strict, Warn, Ignore"}])
    return Options(dry_run=bool(dry), field_validation=fv, checks=checks)


def _drop(doc: Any, loc: tuple[Any, ...]) -> None:
    for part in loc[:-1]:
        doc = doc[part]
    doc.pop(loc[-1], None)


def _model(doc: dict[str, Any], opts: Options) -> RolloutJob:
    """Validate; with Warn/Ignore drop the unknown fields (and only those) and validate again."""
    for _ in range(2):
        try:
            return RolloutJob.model_validate(doc)
        except ValidationError as e:
            unknown = [err["loc"] for err in e.errors() if err["type"] == "extra_forbidden"]
            if opts.field_validation == "Strict" or not unknown or len(unknown) != len(e.errors()):
                raise
            for loc in unknown:
                _drop(doc, tuple(p for p in loc if p != "function-after"))
                if opts.field_validation == "Warn":
                    opts.warnings.append(f'unknown field "{".".join(str(p) for p in loc)}"')
    return RolloutJob.model_validate(doc)


def validate_job(doc: dict[str, Any], url_name: str | None = None, *, namespace: str | None = None,
                 opts: Options | None = None, spec_checks: bool = True) -> RolloutJob:
    """`spec_checks` False: the write leaves the stored spec as it was (the operator's finalizers and annotations,
    labels), so what an upgrade added to the checks (allow-lists, absolute paths) never refuses it."""
    opts = opts or Options()
    causes = []
    if doc.get("apiVersion") != API_VERSION:
        causes.append({"field": "apiVersion", "reason": "FieldValueInvalid",
                       "message": f"must be {API_VERSION!r}, got {doc.get('apiVersion')!r}"})
    if doc.get("kind") != KIND:
        causes.append({"field": "kind", "reason": "FieldValueInvalid",
                       "message": f"must be {KIND!r}, got {doc.get('kind')!r}"})
    if causes:
        raise BadRequest("; ".join(f"{c['field']}: {c['message']}" for c in causes), causes=causes)
    meta = doc.get("metadata")
    body_name = meta.get("name") if isinstance(meta, dict) else None
    if url_name is not None and body_name is not None and body_name != url_name:
        raise BadRequest(
            f"metadata.name {str(body_name)[:100]!r} does not match the name in the URL {url_name!r}",
            causes=[{"field": "metadata.name", "reason": "FieldValueInvalid", "message": "does not match the URL"}],
        )
    body_ns = meta.get("namespace") if isinstance(meta, dict) else None
    if namespace is not None and body_ns not in (None, "", namespace):
        raise BadRequest(
            f"the namespace of the provided object ({str(body_ns)[:63]!r}) does not match the namespace sent on "
            f"the request ({namespace!r})",
            causes=[{"field": "metadata.namespace", "reason": "FieldValueInvalid", "message": "does not match the URL"}])
    if isinstance(meta, dict):
        meta = {**meta, "namespace": namespace or body_ns or DEFAULT_NAMESPACE}
        if url_name is not None and body_name is None:
            meta["name"] = url_name
        meta.pop("managedFields", None)  # server-maintained
        doc = {**doc, "metadata": meta}
    doc = {k: v for k, v in doc.items() if k != "status"}  # status is written through /status only
    try:
        job = _model(doc, opts)
    except ValidationError as e:
        named = body_name if isinstance(body_name, str) else None  # Status.details.name is a string
        raise from_validation_error(e, name=named or url_name, root=RolloutJob) from None
    if spec_checks:
        check_policy(job, opts.checks.allow)
        check_spec(job, opts.checks.shared_filesystem)  # what cannot run: an agent kind the task kind lacks, relative paths, a missing tokenizer
    return job


def validate_status(status: Any, name: str) -> RolloutJobStatus:
    try:
        return RolloutJobStatus.model_validate(status)
    except ValidationError as e:
        raise from_validation_error(e, prefix=("status",), name=name, root=RolloutJobStatus) from None


def check_policy(job: RolloutJob, allow: AllowLists | None = None) -> None:
    """422 for a backend or tokenizer the controller's allow-lists refuse (`allowlists.py`)."""
    llm = job.spec.llm
    problems = [(f"spec.llm.backends[{i}].url", backend_url_problem(b.url, allow)) for i, b in enumerate(llm.backends)]
    if llm.tokenizer is not None:  # absent for agents that make no LLM call (oracle)
        problems.append(("spec.llm.tokenizer", tokenizer_problem(llm.tokenizer, allow)))
    causes = [{"field": f, "reason": "FieldValueForbidden", "message": p} for f, p in problems if p]
    if causes:
        raise Invalid("RolloutJob is invalid: " + "; ".join(f"{c['field']}: {c['message']}" for c in causes),
                      causes=causes, name=job.metadata.name)
