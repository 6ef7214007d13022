"""The `stem` task kind: multiple-choice questions; reward 1 when the chosen letter is the key.

Registered as entry point `stem` (see `registry.get_handler`); the node daemon's RUN pool calls
`StemTask.run`, its EVAL pool `StemTask.eval`. Pure: EVAL never touches a sandbox.

Rows: `{"id", "question", "choices": [...], "answer": "B"}`; `answer` is a letter within the
choices (a 0-based integer index is accepted and turned into the letter at load).
`extract_choice` finds the chosen letter robustly, in this order: `\\boxed{B}`; an answer phrase
("The answer is (B)", "Answer: **b**", "final answer: C)"); a reply that is only a letter
("B", "(b)", "B)", "**B**", "B. Paris"); an answer phrase naming a choice's text ("The answer is
Paris"); a single marked letter anywhere ("(B)", "**B**", "B)"); a single choice's text anywhere.
Lowercase letters count only where they cannot be the English article "a".
"""
from __future__ import annotations

import re
from typing import Any, ClassVar

from rolloutd.crds.trajectory import Trajectory

from .base import Reward, TaskHandler, answer_text
from .seams import Sandbox, SandboxFactory

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

SYSTEM_PROMPT = (
    "You answer multiple-choice questions. Think briefly, then finish with "
    "'The answer is X' where X is the letter of the correct choice."
)


class StemTask(TaskHandler):
    name: ClassVar[str] = "stem"
    needs_sandbox: ClassVar[bool] = False
    fields: ClassVar[dict] = {"id": (str, int), "question": str, "choices": list, "answer": (str, int)}

    def __init__(self, *, system_prompt: str = SYSTEM_PROMPT) -> None:
        self.system_prompt = system_prompt

    def validate_row(self, row: dict, **_: Any) -> None:
        choices = row["choices"]
        if not 2 <= len(choices) <= len(LETTERS):
            raise ValueError(f"field 'choices' needs 2 to {len(LETTERS)} entries, got {len(choices)}")
        if not all(isinstance(c, str) and c.strip() for c in choices):
            raise ValueError("field 'choices' must hold non-empty strings")
        answer = row["answer"]
        if isinstance(answer, int):
            if not 0 <= answer < len(choices):
                raise ValueError(f"field 'answer': index {answer} is outside the {len(choices)} choices")
            row["answer"] = LETTERS[answer]
        else:
            letter = answer.strip().strip("()").upper()
            if len(letter) != 1 or letter not in LETTERS[: len(choices)]:
                raise ValueError(
                    f"field 'answer' must be one of {', '.join(LETTERS[:len(choices)])} (or a choice's index)"
                )
            row["answer"] = letter

    def messages(self, task: dict, tools: list[str]) -> list[dict]:
        system = self.system_prompt
        if "submit" in tools:
            system += " Or call submit with the letter."
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": format_question(task["question"], task["choices"])},
        ]

    async def eval(self, task: dict, sandbox: Sandbox | None, trajectory: Trajectory, *,
                   sandbox_factory: SandboxFactory | None = None) -> Reward:
        text = answer_text(trajectory)
        chosen = extract_choice(text, task["choices"])
        expected = str(task["answer"]).strip().upper()
        return Reward(
            value=1.0 if chosen == expected else 0.0,
            details={"extracted": chosen, "expected": expected,
                     "submitted": trajectory.reward_details.get("submitted"), "final_text": text},
        )


def format_question(question: str, choices: list[str]) -> str:
    lines = [question.strip(), ""]
    lines += [f"{LETTERS[i]}) {_strip_label(c, i)}" for i, c in enumerate(choices)]
    return "\n".join(lines)


def _strip_label(choice: str, i: int) -> str:
    """Choices sometimes arrive labelled ("B) 4", "(B) 4", "B. 4"); drop the label."""
    m = re.match(rf"\(?{LETTERS[i]}[).:]\s+(.*)", choice.strip(), re.S)
    return m.group(1).strip() if m else choice.strip()


def _norm_text(s: str) -> str:
    s = re.sub(r"[*_`$\\]", "", s.lower())
    s = re.sub(r"[^\w\s.+\-/]", " ", s)
    return re.sub(r"\s+", " ", s).strip().rstrip(".")


def _choice_by_text(text: str, choices: list[str]) -> str | None:
    """The letter of the one choice whose text appears in `text` (the longest wins a tie of containment)."""
    hay = f" {_norm_text(text)} "
    hits = []
    for i, choice in enumerate(choices):
        needle = _norm_text(_strip_label(choice, i))
        if needle and f" {needle} " in hay:
            hits.append((i, needle))
    # drop a hit contained in another hit ("4" inside "4 m/s")
    hits = [h for h in hits if not any(h[1] != o[1] and h[1] in o[1] for o in hits)]
    return LETTERS[hits[0][0]] if len(hits) == 1 else None


def extract_choice(text: str, choices: list[str]) -> str | None:
    """The letter the reply chose among `choices`, or None when it is absent or ambiguous."""
    if not text or not text.strip():
        return None
    n = len(choices)
    valid = LETTERS[:n]
    up = f"[{valid}]"
    any_case = f"[{valid}{valid.lower()}]"

    # 1. \boxed{B} / \boxed{\text{B}} (last one)
    boxed = re.findall(r"\\boxed\s*\{\s*(?:\\text\{)?\s*\(?(" + any_case + r")\)?\s*\}?\s*\}", text)
    if boxed:
        return boxed[-1].upper()

    # 2. an answer phrase followed by a letter (last one wins)
    phrase = r"(?:answer|choice|option)(?:\s+is)?(?:\s*(?:is|:|=|-))?\s*(?:option\s+|choice\s+)?"
    letter_pat = (
        rf"(?:\*\*|\()*\s*({any_case})\s*(?:\*\*|\))*"  # B, (B), **B**, b)
        rf"(?=$|[\s.,;:!)*\]])"
    )
    found = [m.group(1) for m in re.finditer(phrase + letter_pat, text, re.I)]
    # a lowercase "a" after "answer is" is most likely the article ("the answer is a prime")
    found = [f for f in found if not (f == "a" and not re.search(r"answer\s*(?::|is\s*:)\s*a\s*$", text, re.I))]
    if found:
        return found[-1].upper()

    # 3. the whole reply is a letter, possibly marked, possibly followed by its text ("B. Paris")
    stripped = text.strip()
    m = re.fullmatch(rf"[\s*(\[]*({any_case})[\s*)\]]*(?:[.):]\s*.*)?", stripped, re.S)
    if m and (m.group(1).isupper() or len(stripped) <= 4):
        return m.group(1).upper()

    # 4. an answer phrase followed by a choice's text ("The answer is Paris.")
    tails = re.findall(r"answer(?:\s+is)?\s*[:=]?\s*(.+)", text, re.I)
    for tail in reversed(tails):
        letter = _choice_by_text(tail.split("\n")[0], choices)
        if letter:
            return letter

    # 5. a single marked letter anywhere: (B), **B**, B)
    marked = re.findall(rf"\(({up})\)|\*\*({up})\*\*|(?<![\w(])({up})\)", text)
    letters = {next(g for g in groups if g) for groups in marked}
    if len(letters) == 1:
        return letters.pop()

    # 6. a single choice's text anywhere in a short reply
    if len(stripped) <= 200:
        return _choice_by_text(stripped, choices)
    return None
