"""`rolloutctl apply -f DIR/job.yaml`: relative paths in the spec resolved against DIR (controller/spec_paths.py),
before the API, which refuses relative ones, sees them."""
from pathlib import Path

from rolloutd.crds.spec_paths import resolve_paths


def doc(source: str, tokenizer: str | None) -> dict:
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "j"},
            "spec": {"tasks": {"kind": "math", "source": source}, "llm": {"tokenizer": tokenizer}}}


def test_relative_paths_resolve_against_the_files_directory(tmp_path):
    (tmp_path / "models" / "real").mkdir(parents=True)
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "tok").symlink_to(tmp_path / "models" / "real")
    original = doc("../data/train.jsonl", "tok")
    out = resolve_paths(original, tmp_path / "jobs")
    assert out["spec"]["tasks"]["source"] == str(tmp_path / "data" / "train.jsonl")
    # a link followed: a link to the models directory stays under the controller's tokenizer roots
    assert out["spec"]["llm"]["tokenizer"] == str((tmp_path / "models" / "real").resolve())
    assert original["spec"]["tasks"]["source"] == "../data/train.jsonl"  # the input is left as it was


def test_absolute_paths_and_model_names_are_sent_as_they_are(tmp_path):
    out = resolve_paths(doc("/data/train.jsonl", "HuggingFaceTB/SmolLM2-135M-Instruct"), tmp_path)
    assert out["spec"]["tasks"]["source"] == "/data/train.jsonl"
    # not a directory here: the API refuses it (tokenizers load offline only), rather than a guess being sent
    assert out["spec"]["llm"]["tokenizer"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_paths({"kind": "RolloutJob"}, tmp_path) == {"kind": "RolloutJob"}
    assert resolve_paths(doc("x.jsonl", None), Path("rel"))["spec"]["tasks"]["source"] == str(Path.cwd() / "rel" / "x.jsonl")


def test_a_model_rolloutd_prepared_is_found_by_its_name(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUTD_HOME", str(tmp_path / "home"))
    from rolloutd.crds.kit.paths import models_dir

    (models_dir() / "smollm2").mkdir(parents=True)
    out = resolve_paths(doc("x.jsonl", "smollm2"), tmp_path)
    assert out["spec"]["llm"]["tokenizer"] == str((models_dir() / "smollm2").resolve())
    assert resolve_paths(doc("x.jsonl", "nope"), tmp_path)["spec"]["llm"]["tokenizer"] == "nope"


def test_the_training_page_snippet_applies_the_example_as_written(controller):
    """docs/content/training.md's trainer snippet, up to its first batch, run from the repository root."""
    import os
    import re
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    page = (repo / "docs" / "content" / "training.md").read_text()
    snippet = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "next_batch" in b)
    head = snippet.split("    for step")[0] + "    print(rc.get('grpo-demo')['spec']['tasks']['source'])\n"
    env = {**os.environ, "ROLLOUTD_SERVER": controller.url, "ROLLOUTD_TOKEN": controller.token}
    r = subprocess.run([sys.executable, "-c", head], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(repo / "examples" / "math" / "train.jsonl")
