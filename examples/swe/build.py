"""Build the `swe` example: a git repository with injected bugs, and its SWE-bench-style instances.

Inputs (plain files, committed): `minilib/` — a small, correct pure-Python library with a real
pytest suite — and `BUGS` below. Outputs (committed too, rebuilt by `python examples/swe/build.py`):

- `minilib.git.tar.gz`: a bare git repository. Commit `main` is the correct library; each instance
  has a branch whose single commit on top injects one bug and drops the tests that expose it.
  Author, committer and dates are fixed, so the commit ids (the instances' `base_commit`) are stable.
- `train.jsonl`: one instance per bug, SWE-bench field names (`instance_id`, `problem_statement`,
  `base_commit`, `FAIL_TO_PASS`, `PASS_TO_PASS`, `test_patch`, `patch` = the gold fix) plus
  `repo_path` (relative to this folder) and `test_command` (`{python}` is replaced by the handler).

The build checks every instance for real: at base + test_patch every FAIL_TO_PASS test fails and
every PASS_TO_PASS test passes; with the gold patch too, all pass. `tests/agents/tasks/test_swe.py` rebuilds
into a temporary folder and fails when the committed `train.jsonl` is stale.
Used by: the `swe` task handler (`rolloutd.agents.tasks.swe`) through `train.jsonl`; no rolloutd import.
"""
from __future__ import annotations

import ast
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "minilib"
TEST_COMMAND = "{python} -m pytest -rA -p no:cacheprovider"

BUGS = [
    {
        "instance_id": "minilib__minilib-1",
        "file": "minilib/stats.py",
        "old": "    return (ordered[mid - 1] + ordered[mid]) / 2\n",
        "new": "    return ordered[mid]\n",
        "tests": {"tests/test_stats.py": ["test_median_even"]},
        "problem_statement": (
            "median() is wrong for an even number of values\n\n"
            "`minilib.stats.median([4, 1, 3, 2])` returns `3`, but the median of an even-sized sample "
            "is the mean of the two middle values, `2.5`. Odd-sized inputs work fine."
        ),
    },
    {
        "instance_id": "minilib__minilib-2",
        "file": "minilib/sequences.py",
        "old": "range(0, len(items), size)",
        "new": "range(0, len(items) - size + 1, size)",
        "tests": {"tests/test_sequences.py": ["test_chunk_keeps_remainder"]},
        "problem_statement": (
            "chunk() silently drops the last, shorter chunk\n\n"
            "`chunk([1, 2, 3, 4, 5], 2)` gives `[[1, 2], [3, 4]]`: the trailing `5` is lost. "
            "The docstring says the last chunk may be shorter, so I expected `[[1, 2], [3, 4], [5]]`."
        ),
    },
    {
        "instance_id": "minilib__minilib-3",
        "file": "minilib/calendar.py",
        "old": "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
        "new": "    return year % 4 == 0 and year % 100 != 0\n",
        "tests": {"tests/test_calendar.py": ["test_every_400th_year_is_leap"]},
        "problem_statement": (
            "is_leap_year(2000) returns False\n\n"
            "2000 was a leap year (divisible by 400), yet `minilib.calendar.is_leap_year(2000)` is False, "
            "and `days_in_month(2000, 2)` gives 28 instead of 29."
        ),
    },
    {
        "instance_id": "minilib__minilib-4",
        "file": "minilib/text.py",
        "old": 'r"[^a-zA-Z0-9]+"',
        "new": 'r"[^a-zA-Z0-9]"',
        "tests": {"tests/test_text.py": ["test_slugify_punctuation_runs"]},
        "problem_statement": (
            "slugify produces doubled separators\n\n"
            '`slugify("Hello,  World!")` returns `"hello---world"`. Runs of punctuation and spaces '
            'should collapse into a single separator: `"hello-world"`.'
        ),
    },
    {
        "instance_id": "minilib__minilib-5",
        "file": "minilib/text.py",
        "old": "    return text[: width - len(placeholder)] + placeholder\n",
        "new": "    return text[:width] + placeholder\n",
        "tests": {"tests/test_text.py": ["test_truncate_cuts_with_placeholder"]},
        "problem_statement": (
            "truncate() returns strings longer than the width\n\n"
            '`truncate("abcdefghij", 6)` returns `"abcdef..."` (9 characters). The result must not be '
            'longer than `width`, placeholder included: `"abc..."`.'
        ),
    },
]

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "minilib", "GIT_AUTHOR_EMAIL": "minilib@example.invalid",
    "GIT_COMMITTER_NAME": "minilib", "GIT_COMMITTER_EMAIL": "minilib@example.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+00:00", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+00:00",
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
}


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, **_GIT_ENV}
    return subprocess.run(["git", "-c", "commit.gpgsign=false", *args], cwd=cwd, env=env, check=True,
                          capture_output=True, text=True).stdout


def _copy_source(dest: Path) -> None:
    shutil.copytree(SOURCE, dest, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))


def _drop_tests(path: Path, names: list[str]) -> None:
    """Remove the named top-level test functions (and the blank lines before them)."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    spans = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            start = node.lineno - 1 - len(node.decorator_list)
            while start > 0 and not lines[start - 1].strip():
                start -= 1
            spans.append((start, node.end_lineno))
    missing = set(names) - {n.name for n in ast.parse(text).body if isinstance(n, ast.FunctionDef)}
    if missing:
        raise SystemExit(f"{path}: no test named {sorted(missing)}")
    for start, end in sorted(spans, reverse=True):
        del lines[start:end]
    path.write_text("".join(lines))


def _pytest(repo: Path) -> dict[str, str]:
    """Outcome per test id in a worktree, from `pytest -rA`."""
    out = subprocess.run([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider"], cwd=repo,
                         capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout
    status = {}
    for line in out.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR") and "::" in rest:
            status[rest.split(" - ")[0].strip()] = word
    return status


def _deterministic_tar(src: Path, dest: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted([src, *src.rglob("*")]):
            info = tar.gettarinfo(str(path), arcname=str(Path(src.name) / path.relative_to(src)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o755 if info.isdir() else 0o644
            with (path.open("rb") if info.isfile() else io.BytesIO()) as f:
                tar.addfile(info, f if info.isfile() else None)
    with dest.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        gz.write(buf.getvalue())


def build(out: Path, verify: bool = True) -> list[dict]:
    """Write `minilib.git.tar.gz` and `train.jsonl` into `out`; return the instances.

    `verify=False` skips running each instance's tests before and after the fix (the rows are the
    same; only the check is skipped): the staleness test uses it to stay fast.
    """
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="minilib-build-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        git(work, "init", "-q", "--template=", "-b", "main")
        _copy_source(work)
        git(work, "add", "-A")
        git(work, "commit", "-q", "-m", "minilib 0.3.0")
        clean = git(work, "rev-parse", "HEAD").strip()
        all_tests = _pytest(work)
        if not all_tests or set(all_tests.values()) != {"PASSED"}:
            raise SystemExit(f"the clean library must pass its own tests: {all_tests}")

        for bug in BUGS:
            iid = bug["instance_id"]
            git(work, "checkout", "-q", "-B", iid, clean)
            target = work / bug["file"]
            code = target.read_text()
            if code.count(bug["old"]) != 1:
                raise SystemExit(f"{iid}: the injection must match {bug['file']} exactly once")
            target.write_text(code.replace(bug["old"], bug["new"]))
            for test_file, names in bug["tests"].items():
                _drop_tests(work / test_file, names)
            git(work, "commit", "-q", "-am", f"{iid}: base")
            base = git(work, "rev-parse", "HEAD").strip()
            test_patch = git(work, "diff", base, clean, "--", "tests")
            gold = git(work, "diff", base, clean, "--", ".", ":(exclude)tests")
            f2p = [f"{f}::{n}" for f, names in bug["tests"].items() for n in names]
            p2p = sorted(t for t in all_tests if t not in f2p)

            # check the instance for real: failing before the fix, passing after it
            if verify:
                _verify(work, iid, test_patch, gold, f2p, p2p)

            rows.append({
                "instance_id": iid,
                "repo": "rolloutd/minilib",
                "base_commit": base,
                "problem_statement": bug["problem_statement"],
                "hints_text": "",
                "version": "0.3",
                "FAIL_TO_PASS": f2p,
                "PASS_TO_PASS": p2p,
                "test_patch": test_patch,
                "patch": gold,
                "repo_path": "minilib.git.tar.gz",
                "test_command": TEST_COMMAND,
            })
        git(work, "checkout", "-q", "main")

        bare = Path(tmp) / "minilib.git"
        git(Path(tmp), "clone", "-q", "--bare", "--no-local", "--template=", str(work), str(bare))
        git(bare, "fetch", "-q", str(work), *(f"refs/heads/{b['instance_id']}:refs/heads/{b['instance_id']}" for b in BUGS))
        git(bare, "remote", "remove", "origin")
        git(bare, "pack-refs", "--all")
        for extra in ("logs", "FETCH_HEAD", "description", "hooks", "info"):
            p = bare / extra
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
        _deterministic_tar(bare, out / "minilib.git.tar.gz")

    with (out / "train.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def _verify(work: Path, iid: str, test_patch: str, gold: str, f2p: list[str], p2p: list[str]) -> None:
    _apply(work, test_patch)
    before = _pytest(work)
    if any(before.get(t) == "PASSED" for t in f2p) or any(before.get(t) != "PASSED" for t in p2p):
        raise SystemExit(f"{iid}: FAIL_TO_PASS must fail and PASS_TO_PASS pass at base: {before}")
    _apply(work, gold)
    after = _pytest(work)
    if any(after.get(t) != "PASSED" for t in f2p + p2p):
        raise SystemExit(f"{iid}: the gold patch must make every test pass: {after}")
    git(work, "checkout", "-q", "--", ".")


def _apply(repo: Path, patch: str) -> None:
    env = {**os.environ, **_GIT_ENV}
    subprocess.run(["git", "apply", "-"], cwd=repo, env=env, input=patch, text=True, check=True,
                   capture_output=True)


if __name__ == "__main__":
    for row in build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(row["instance_id"], row["base_commit"], row["FAIL_TO_PASS"])
