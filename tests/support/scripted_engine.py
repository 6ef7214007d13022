"""A scripted policy INSIDE the real vLLM engine: a logits processor that forces a scripted answer on a request
whose prompt carries the marker, and does nothing to any other request.

Runs in the ENGINE's venv, not the tests' (it imports torch and vllm): tests/support/engine_fixtures.py starts
the session's tiny engine with `--logits-processors support.scripted_engine:ScriptedPolicy` and tests/ on its
PYTHONPATH (support/scripted_policy.py: the marker, the script format and the engine arguments). Next step:
the harness tests (tests/agents/test_gateway_harnesses.py) put a script in a harness's prompt and check that the
harness executed the scripted tool call in the sandbox.

A script is `MARKER:<base64 of JSON [[when, text], ...]>` in the prompt: the answer is the text of the first
step whose `when` occurs in the prompt's text (null: always), then the end-of-sequence token. Unmarked
requests cost one search of the prompt's ids (bytes.find) when they join the batch and nothing per step.

Pacing: while the file named by $SCRIPTED_ENGINE_PACE exists, every step sleeps the milliseconds it holds (a test
that needs a generation to last, `scripted_policy.paced`); without it, one failed open per step.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
import time
from array import array

import torch
from transformers import AutoTokenizer
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

MARKER = "scriptedpolicy"  # letters only: its own pre-token after a space or a newline, whatever follows
_SCRIPT = re.compile(MARKER + r":([A-Za-z0-9+/=]+)")
PACE = os.environ.get("SCRIPTED_ENGINE_PACE")


def _pace() -> None:
    """Sleep the step out while the pace file exists (its content: milliseconds per step)."""
    try:
        with open(PACE) as f:
            ms = float(f.read() or 0)
    except (OSError, ValueError):
        return
    time.sleep(min(ms, 1000) / 1000)


def _ids_bytes(ids) -> bytes:
    return array("i", ids).tobytes()


class ScriptedPolicy(LogitsProcessor):
    """Batch index → (the scripted ids, the request's live output ids) for the marked requests only."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.tok = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        self.eos = self.tok.eos_token_id
        # the marker as it is encoded after a space and after a newline (or at the start)
        self.needles = {_ids_bytes(self.tok.encode(text, add_special_tokens=False)) for text in (" " + MARKER, MARKER)}
        self.active: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes what greedy sampling picks

    def script_for(self, prompt_ids) -> list[int] | None:
        """The ids to force for this prompt, or None when it carries no (readable) script."""
        if not prompt_ids:
            return None
        raw = _ids_bytes(prompt_ids)
        if not any(self._aligned_find(raw, needle) for needle in self.needles):
            return None
        text = self.tok.decode(prompt_ids)
        found = _SCRIPT.search(text)
        if found is None:
            return None
        try:
            steps = json.loads(base64.b64decode(found.group(1)))
        except (binascii.Error, ValueError):
            return None
        for when, answer in steps:
            if when is None or when in text:
                return self.tok.encode(answer, add_special_tokens=False) + [self.eos]
        return None

    @staticmethod
    def _aligned_find(raw: bytes, needle: bytes) -> bool:
        at = raw.find(needle)
        while at >= 0 and at % 4:  # a match must start on a whole id
            at = raw.find(needle, at + 1)
        return at >= 0

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self.active.pop(index, None)
        for index, _params, prompt_ids, output_ids in batch_update.added:
            script = self.script_for(prompt_ids)
            if script is None:
                self.active.pop(index, None)
            else:
                self.active[index] = (script, output_ids)
        for a, b, direction in batch_update.moved:
            moving = self.active.pop(a, None)
            staying = self.active.pop(b, None)
            if moving is not None:
                self.active[b] = moving
            if direction == MoveDirectionality.SWAP and staying is not None:
                self.active[a] = staying

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if PACE:
            _pace()
        for index, (script, output_ids) in self.active.items():
            at = len(output_ids)
            token = script[at] if at < len(script) else self.eos
            logits[index] = float("-inf")
            logits[index, token] = 0.0
        return logits
