"""Relative paths in a RolloutJob file, made absolute against the file's directory (as kustomize and compose do).

Called by `rolloutctl apply -f FILE` (`controller/ctl/files.py`) on each document before it is sent: the API refuses a
relative `spec.tasks.source` or `spec.llm.tokenizer` (`controller/spec_checks.py`,
`controller/access/allowlists.py`), since it would resolve against whichever directory the controller or a daemon
runs in. From stdin (`-f -`) the base is the working directory.
- `spec.tasks.source`: always resolved.
- `spec.llm.tokenizer`: resolved (symbolic links followed, so a link into the models directory stays under the
  tokenizer roots) when that names a directory; else, when it names a model rolloutd prepared (`smollm2`,
  `rolloutd serve-model --prepare-only --model smollm2`), that model's directory; any other value is sent as it
  is, and the API refuses it: tokenizers load offline only, so a model hub name cannot load.
Also called by the Python client's `apply(path)` / `load_job(path)` (`client/calls.py`), with the file's directory.
Next step: the API's validation (`kube/validate.py`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def resolve_paths(doc: dict[str, Any], base: Path) -> dict[str, Any]:
    """`doc` with its spec's relative paths made absolute against `base` (the input is not changed)."""
    spec = doc.get("spec")
    if not isinstance(spec, dict):
        return doc
    spec = dict(spec)
    tasks, llm = spec.get("tasks"), spec.get("llm")
    if isinstance(tasks, dict) and _relative(tasks.get("source")):
        spec["tasks"] = {**tasks, "source": os.path.normpath(base.absolute() / tasks["source"])}
    if isinstance(llm, dict) and _relative(llm.get("tokenizer")):
        found = _tokenizer_dir(llm["tokenizer"], base)
        if found is not None:
            spec["llm"] = {**llm, "tokenizer": found}
    return {**doc, "spec": spec}


def _tokenizer_dir(name: str, base: Path) -> str | None:
    """A relative tokenizer's directory: beside the file, else a model rolloutd prepared; None if neither."""
    if (base / name).is_dir():
        return os.path.realpath(base / name)
    from rolloutd.crds.kit.paths import models_dir

    prepared = models_dir() / name
    if "/" not in name and name not in (".", "..") and prepared.is_dir():
        return os.path.realpath(prepared)
    return None


def _relative(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip()) and not value.startswith(("/", "~"))
