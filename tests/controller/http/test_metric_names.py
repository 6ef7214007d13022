"""Every metric the docs name is one the controller serves, under the name a Prometheus query uses (a counter's
samples end in `_total`; a histogram is named by its family). Reads the docs and a real controller's /metrics.
training.md is left out: its `rolloutd_*` names are TRL dataset fields, not metrics."""
from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[3] / "docs" / "content"


def served(text: str) -> set[str]:
    """The names a query may use: every sample's, and the family name of histograms and summaries."""
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    families = {m[1] for m in re.finditer(r"^# TYPE (\S+) (histogram|summary)$", text, re.M)}
    gauges = {m[1] for m in re.finditer(r"^# TYPE (\S+) gauge$", text, re.M)}  # a labelled gauge may have no sample
    # so may a labelled counter (the work share's held calls, before any was held): a query names it `…_total`
    counters = {f"{m[1].removesuffix('_total')}_total" for m in re.finditer(r"^# TYPE (\S+) counter$", text, re.M)}
    return names | families | gauges | counters


def test_every_metric_the_docs_name_is_served(bad_api):
    names = served(bad_api.get("/metrics").text)
    # `rolloutd_x_*` names a family of metrics (one at least served); `NOTIFY rolloutd_…` is PostgreSQL's channel
    documented = {(page.name, m) for page in DOCS.glob("*.md") if page.name != "training.md"
                  for m in re.findall(r"(?<!NOTIFY )\b(rolloutd_[a-z_]+\*?)", page.read_text())}
    assert documented, "the docs name no metric"
    missing = [(page, m) for page, m in sorted(documented)
               if not (any(n.startswith(m[:-1]) for n in names) if m.endswith("*") else m in names)]
    assert not missing, sorted(names)
