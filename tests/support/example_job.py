"""The example job (examples/math-demo.yaml) as `rolloutctl apply -f` sends it: its relative paths made absolute
against the file's directory (`controller/spec_paths.py`), as the API wants them. Its tokenizer, a link the demo
makes, becomes rolloutd's prepared model directory when the link is not there (these tests load no tokenizer).
Shared by the controller and Kubernetes-API tests."""
from __future__ import annotations

import os
from pathlib import Path

import yaml

from rolloutd.crds.spec_paths import resolve_paths
from rolloutd.crds.kit.paths import models_dir

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math-demo.yaml"


def example_doc() -> dict:
    doc = resolve_paths(yaml.safe_load(EXAMPLE.read_text()), EXAMPLE.parent)
    if not os.path.isabs(doc["spec"]["llm"]["tokenizer"]):
        doc["spec"]["llm"]["tokenizer"] = str(models_dir() / "smollm2")
    return doc


def example_yaml() -> str:
    return yaml.safe_dump(example_doc(), sort_keys=False)
