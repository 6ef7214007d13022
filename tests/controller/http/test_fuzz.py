"""Schemathesis against a real controller process, on each store: every operation of /openapi.json, bodies included,
positive and negative examples; the assertion is no 5xx and every response as documented (status code,
content type, schema). Bounded: `EXAMPLES` per operation and mode (hypothesis, no shrinking, no
database). Streams do not hang it: `watch`, `follow` and `wait` requests get `timeoutSeconds` ≤ 1 s.

Driven through schemathesis's Python API (operation strategies under hypothesis) rather than its
pytest plugin, whose lazy fixture loader does not work with pytest 9. `PYTHONPATH=tests python -m
tests.controller.http.test_fuzz URL TOKEN [SCHEMA_URL_OR_FILE]` runs the same fuzzing against any controller and
prints the counts (bench/results/RESULTS-api.md)."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import httpx
import hypothesis
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                               status_code_conformance)

from rolloutd.crds.names import API_PREFIX
from support.controller_process import ControllerProcess
from support.example_job import example_doc

EXAMPLES = 12
SEED_JOB = "fuzz-seed"  # a batch-mode job: most cases address it, so they reach past the 404
STREAMING = ("watch", "follow", "wait")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def seed(url: str, auth: dict) -> None:
    job = example_doc()  # its paths resolved: the API refuses relative ones
    job["metadata"]["name"] = SEED_JOB
    job["spec"]["batches"] = {"groups": 2}
    r = httpx.put(f"{url}{API_PREFIX}/rolloutjobs/{SEED_JOB}", json=job, headers=auth)
    assert r.status_code in (200, 201), r.text


def aim(case) -> None:
    """Point a case at the seeded job (or a PUT at its own body's name); bound streams to 1 s."""
    params = case.path_parameters or {}
    body_name = case.body.get("metadata", {}).get("name") if isinstance(case.body, dict) \
        and isinstance(case.body.get("metadata"), dict) else None
    if "name" in params and case.method == "PUT" and case.path.endswith("{name}") and isinstance(body_name, str):
        params["name"] = body_name
    elif "name" in params and case.method != "DELETE":
        params["name"] = SEED_JOB
    query = case.query if isinstance(case.query, dict) else {}
    if any(str(query.get(k, "")).lower() in ("true", "1", "yes", "on") for k in STREAMING):
        case.query = {**query, "timeoutSeconds": 1}


def fuzz(url: str, token: str, schema_url: str | None = None, examples: int = EXAMPLES) -> dict:
    """Run every operation's positive and negative strategies; count cases, 5xx and other failures."""
    auth = {"Authorization": f"Bearer {token}"}
    seed(url, auth)
    if schema_url and not schema_url.startswith("http"):  # a saved document, to fuzz an older controller
        schema = schemathesis.openapi.from_path(schema_url)
    else:
        schema = schemathesis.openapi.from_url(schema_url or f"{url}/openapi.json", headers=auth)
    stats: Counter = Counter()
    failures: dict[str, str] = {}

    def call(case) -> None:
        aim(case)
        stats["cases"] += 1
        response = case.call(base_url=url, headers=auth, timeout=30)
        stats[f"{case.operation.label} {response.status_code}"] += 1
        if response.status_code >= 500:
            stats["5xx"] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - a FailureGroup: record, keep fuzzing
            stats["failed"] += 1
            reasons = "; ".join(str(x).splitlines()[0][:160] for x in getattr(e, "exceptions", [e]))
            key = f"{case.operation.label} → {response.status_code}: {reasons}"
            failures.setdefault(key, f"{case.method} {case.formatted_path} query={case.query} "
                                     f"body={str(case.body)[:300]} → {response.text[:300]}")

    settings = hypothesis.settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                                   phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
                                   suppress_health_check=list(hypothesis.HealthCheck))
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                settings(hypothesis.given(case=operation.as_strategy(generation_mode=mode))(lambda case: call(case)))()
            except hypothesis.errors.Unsatisfiable:  # e.g. no negative variant of a parameterless operation
                stats["unsatisfiable"] += 1
    return {"cases": stats["cases"], "5xx": stats["5xx"], "failed": stats["failed"], "failures": failures,
            "unsatisfiable": stats["unsatisfiable"],
            "codes": {k: v for k, v in sorted(stats.items()) if " " in k}}


def test_no_5xx_and_every_response_as_documented(tmp_path, store_location):
    """On both stores: PostgreSQL refuses what SQLite takes (NUL in text, an index row over 8 KB)."""
    controller = ControllerProcess(tmp_path / "data", extra_args=("--store", str(store_location))).start()
    try:
        report = fuzz(controller.url, controller.token)
    finally:
        controller.stop()
    assert report["cases"] > 200
    assert report["failures"] == {}, json.dumps(report["failures"], indent=1)
    assert report["5xx"] == 0


if __name__ == "__main__":  # pragma: no cover - the bench entry point
    out = fuzz(*sys.argv[1:4])
    print(json.dumps({k: out[k] for k in ("cases", "5xx", "failed", "codes")}, indent=1))
    for key, example in out["failures"].items():
        print(" ", key, "\n    ", example)
