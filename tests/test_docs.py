"""The documentation site: built strictly with the real mkdocs, its generated reference fresh and complete,
the README a front door.

A broken link or anchor, a page left out of the navigation, a spec field without a description or a stale
reference page fails here, so the manual cannot drift from the code.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutd.crds.kit import reference

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# what only one machine has, or words only this project's sessions use
MACHINE_SPECIFIC = re.compile(r"(?<![\w.])/work/|/root/\.|quiet lock|\bhelpers?'")  # not controller/work/


def test_the_generated_reference_is_fresh():
    for name, text in reference.pages().items():
        page = reference.DOCS_REFERENCE / name
        assert page.is_file() and page.read_text() == text, f"docs/content/reference/{name} is stale: run `rolloutd crd`"


def test_a_field_without_a_description_fails_the_reference():
    from pydantic import Field

    from rolloutd.crds.base import Model

    class Inner(Model):
        """An object."""
        described: int = Field(default=1, description="has one")
        bare: int = 2

    class Outer(Model):
        inner: Inner = Field(default_factory=Inner)

    with pytest.raises(reference.Undescribed, match=r"spec\.inner\.bare"):
        reference.render("T", "", Outer, "spec")


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(DOCS / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "rolloutjob" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    """The strictness is real: the same site with one broken anchor does not build."""
    import shutil
    copy = tmp_path / "docs"
    shutil.copytree(DOCS, copy, ignore=shutil.ignore_patterns("site"))
    page = copy / "content" / "operations.md"
    page.write_text(page.read_text() + "\nSee [the jobs](jobs.md#no-such-section).\n")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(copy / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no-such-section" in done.stdout + done.stderr


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for heading in ("## The two commands", "## Your first job on your own controller", "## Where to go next"):
        assert heading in readme
    for path in re.findall(r"`(docs/content/[^`\s]+\.md)`", readme):
        assert (ROOT / path).is_file(), f"the README names {path}, which does not exist"


def test_no_machine_paths_or_internal_jargon():
    for path in [ROOT / "README.md", *sorted((DOCS / "content").rglob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not MACHINE_SPECIFIC.search(line), f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"


def test_the_architecture_page_names_only_files_that_exist():
    """docs/content/architecture.md walks a rollout file by file: every repository path it names in backticks
    exists, so the page stays true when code moves."""
    page = (DOCS / "content" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:controller|agents|sandbox|crds|charts|sim|tests|bench|examples)/[\w./-]+\.(?:py|md|yaml))`", page))
    assert len(named) >= 30, sorted(named)  # the hops are there
    assert sorted(p for p in named if not (ROOT / p).is_file()) == []
