"""One vocabulary and one reward definition everywhere a user reads them: the API (status.counts, the CRD's
columns), the CLI (`get`, `describe`, `watch`), the web UI (jobs.js) and the docs. The words and the definition
are `crds/columns.py`'s OUTCOMES and REWARD_MEAN; this test reads every place that shows them."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from rolloutd.controller.ctl import views
from rolloutd.crds.columns import OUTCOMES, PRINTER_COLUMNS, REWARD_MEAN
from rolloutd.crds.job_status import StageCounts
from rolloutd.crds.rolloutjob import RolloutJob

REPO = Path(__file__).resolve().parents[1]
OLD = ("succeeded", "failed")  # status.counts keeps them for older clients; no user-facing table shows them


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_api_counts_every_outcome_and_the_crd_defines_the_reward():
    fields = StageCounts.model_json_schema(by_alias=True)["properties"]
    assert set(OUTCOMES) <= set(fields)
    crd = yaml.safe_load((REPO / "crds" / "rolloutjob.yaml").read_text())
    columns = {c["name"]: c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert [c["name"].lower() for c in PRINTER_COLUMNS if c["jsonPath"].startswith(".status.counts.")
            and c["jsonPath"].rsplit(".", 1)[1] in OUTCOMES] == [w for w in OUTCOMES.values()]
    assert columns["Reward"]["description"] == REWARD_MEAN


def test_the_cli_says_the_four_words_and_the_reward_definition():
    from support.example_job import example_doc

    job = RolloutJob.model_validate(example_doc()).wire()
    job["status"] = {"phase": "Running", "counts": {"total": 4, "scored": 1, "agentFailed": 1, "infraFailed": 1,
                                                    "cancelled": 1}, "rewardMean": 0.5}
    line = views.progress_line(job)
    assert all(f"{w}=1" in line for w in OUTCOMES.values()) and not any(f" {w}=" in line for w in OLD)
    header = views.jobs_table([job], wide=True).splitlines()[0].lower().split()
    assert all(w in header for w in OUTCOMES.values()) and not set(OLD) & set(header)
    assert REWARD_MEAN in views.describe_text(job, [], None)


def test_the_web_ui_says_the_four_words_and_the_reward_definition():
    js = (REPO / "controller" / "ui" / "static" / "jobs.js").read_text()
    stages = re.search(r"const STAGES = \[(.*?)\];", js).group(1)
    keys = re.findall(r'"(\w+)"', stages)
    assert [k for k in keys if k in OUTCOMES] == list(OUTCOMES) and not set(OLD) & set(keys)
    assert f'"{REWARD_MEAN}"' in js
    for key, word in OUTCOMES.items():
        assert key == word or f'{key}: "{word}"' in js


def test_the_docs_say_the_four_words_and_the_one_reward_definition():
    docs = {p.name: flat(p.read_text()) for p in (REPO / "docs" / "content").glob("*.md")}
    status = docs["status.md"]
    for key in OUTCOMES:
        assert f"| `{key}` |" in status
    for page in ("status.md", "jobs.md", "cli.md"):
        assert flat(REWARD_MEAN) in docs[page], page
    for name, text in docs.items():  # no other definition of the reward anywhere
        assert "mean of the scored)" not in text and "mean reward of the scored rollouts" not in text, name
