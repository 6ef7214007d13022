"""`rolloutctl apply -f DIR/job.yaml`: relative paths in the spec resolved against DIR (controller/spec_paths.py),
before the API, which refuses relative ones, sees them."""
from pathlib import Path

from rolloutd.controller.spec_paths import resolve_paths


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
