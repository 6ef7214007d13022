"""The `math` task kind: a question, a reference answer, reward 1 when the agent's final answer
is mathematically equal to it.

Registered as entry point `math` (see `registry.get_handler`); the node daemon's RUN pool calls
`MathTask.run`, its EVAL pool `MathTask.eval`. Pure: EVAL never touches a sandbox, so the tool-less
mode (no sandbox) works; with tools the agent may compute in its sandbox.

Rows: `{"id", "question", "answer"}` (answer: a string or a number), more fields allowed.
Answer extraction: the content of the LAST `\\boxed{...}` (nested braces handled). Without one,
unless the handler was built with `require_boxed=True`, the whole reply when it is a bare number or
expression ("What is 2 + 3? Answer with just the number." -> "5"), else the last number in it.
Equivalence: equal after normalisation (LaTeX stripped, `\\frac`/`\\dfrac` -> division, thousands
separators, `x = ...` prefixes, units like degrees/percent), else equal as sympy values
(2/4 = 0.5 = 1/2, `\\sqrt{8}` = `2\\sqrt{2}`). Agent text never reaches sympy's parser unless it
passes a whitelist of characters and names (sympy parses with `eval`), and sympy runs only in a worker process
with a time bound (`judge.py`: a whitelisted answer can still make it compute for ever); a judgement stopped
there scores 0, its details saying so.
"""
from __future__ import annotations

import re
from typing import Any, ClassVar

from rolloutd.crds.errors import RolloutdError
from rolloutd.crds.trajectory import Trajectory

from .base import Reward, TaskHandler, answer_text
from .judge import JudgementTimedOut, judged
from .seams import Sandbox, SandboxFactory

SYSTEM_PROMPT = (
    "You are a careful mathematician. Solve the problem step by step. "
    "Put your final answer in \\boxed{}, for example \\boxed{42}."
)


class MathTask(TaskHandler):
    name: ClassVar[str] = "math"
    needs_sandbox: ClassVar[bool] = False
    fields: ClassVar[dict] = {"id": (str, int), "question": str, "answer": (str, int, float)}

    def __init__(self, *, require_boxed: bool = False, system_prompt: str = SYSTEM_PROMPT) -> None:
        self.require_boxed = require_boxed
        self.system_prompt = system_prompt

    def validate_row(self, row: dict, **_: Any) -> None:
        if not str(row["answer"]).strip():
            raise ValueError("field 'answer' is empty")
        if not str(row["question"]).strip():
            raise ValueError("field 'question' is empty")

    def messages(self, task: dict, tools: list[str]) -> list[dict]:
        system = self.system_prompt
        if set(tools) - {"submit"}:
            system += " You may use the tools to compute; they run in a sandbox."
        if "submit" in tools:
            system += " When you are done, call submit with the final answer."
        return [{"role": "system", "content": system}, {"role": "user", "content": task["question"]}]

    async def eval(self, task: dict, sandbox: Sandbox | None, trajectory: Trajectory, *,
                   sandbox_factory: SandboxFactory | None = None) -> Reward:
        text, expected = answer_text(trajectory), str(task["answer"])
        stopped = None
        try:  # on the loop while no sympy is needed (a string or integer comparison: microseconds)
            extracted, ok = _judge(text, expected, self.require_boxed, symbolic=False)
        except _Symbolic:
            # sympy in a worker: its first import (~1.5 s) would hold the daemon's loop (the node's beats, a weight
            # update's fence: #38), and a thread could not be stopped
            try:
                extracted, ok = await judged(_judge, text, expected, self.require_boxed)
            except JudgementTimedOut as e:
                extracted, ok, stopped = extract_answer(text, require_boxed=self.require_boxed), False, str(e)
        details = {"extracted": extracted, "expected": expected,
                   "submitted": trajectory.reward_details.get("submitted"), "final_text": text}
        if stopped:
            details["judgement"] = stopped
        return Reward(value=1.0 if ok else 0.0, details=details)


# ---------------------------------------------------------------------- extraction
_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


class _Symbolic(RolloutdError):
    """The comparison needs sympy (asked not to use it); caught in `MathTask.eval`, never a failure."""


def _judge(text: str, expected: str, require_boxed: bool, symbolic: bool = True) -> tuple[str | None, bool]:
    """The answer extracted from the agent's text, and whether it equals `expected`. `symbolic=False`: raise
    `_Symbolic` rather than call sympy."""
    extracted = extract_answer(text, require_boxed=require_boxed)
    return extracted, extracted is not None and is_equiv(extracted, expected, symbolic=symbolic)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\boxed 5`, `\\fbox{...}`), braces balanced."""
    for match in reversed(list(_BOXED.finditer(text))):
        i = match.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, start = 0, i + 1
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start:j].strip()
            continue  # unbalanced: try an earlier one
        m = re.match(r"[^\s$]+", text[i:])  # `\boxed 5`
        if m:
            return m.group(0).rstrip(".")
    return None


def extract_answer(text: str, *, require_boxed: bool = False) -> str | None:
    """The agent's final answer in `text`, or None when there is none."""
    boxed = last_boxed(text)
    if boxed is not None or require_boxed:
        return boxed
    bare = text.strip().strip("$").strip().rstrip(".").strip()
    if bare and len(bare) <= 40 and _sympy_safe(_normalize(bare)):
        return bare
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


# ---------------------------------------------------------------------- normalisation
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_UNITS = re.compile(
    r"\\?\s*(?:degrees?|cm|km|mm|m|meters?|units?|dollars?|cents?|inches|feet|ft|hours?|minutes?|seconds?|sq)\s*$"
)


def _replace_latex(s: str) -> str:
    """Innermost first: `\\frac{a}{b}`/`\\frac12` -> `(a)/(b)`, `\\sqrt{x}` -> `sqrt(x)`, `^{n}` -> `**(n)`."""
    rules = [
        (re.compile(r"\\sqrt\s*\{([^{}]*)\}"), lambda m: f"sqrt({m.group(1)})"),
        (re.compile(r"\\sqrt\s*(\d+|[a-zA-Z])"), lambda m: f"sqrt({m.group(1)})"),
        (re.compile(r"\\frac\s*(\{[^{}]*\}|\d|[a-zA-Z])\s*(\{[^{}]*\}|\d|[a-zA-Z])"),
         lambda m: "({})/({})".format(*(g[1:-1] if g.startswith("{") else g for g in m.groups()))),
        (re.compile(r"\^\s*\{([^{}]*)\}"), lambda m: f"**({m.group(1)})"),
    ]
    for _ in range(50):
        for pattern, repl in rules:
            new = pattern.sub(repl, s, count=1)
            if new != s:
                s = new
                break
        else:
            return s
    return s


def _normalize(s: str) -> str:
    s = str(s).strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(3):
        s = _TEXT_WRAPPERS.sub(r"\1", s)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "\\displaystyle"):
        s = s.replace(token, "")
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s)  # degrees
    s = s.replace("\\%", "").replace("%", "")
    s = s.strip().rstrip(".").strip()
    # `x = 5`, `y=\frac12`: keep the right-hand side of a single-variable equation
    m = re.fullmatch(r"[a-zA-Z]\s*=\s*(.+)", s)
    if m:
        s = m.group(1)
    s = _UNITS.sub("", s).strip()
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)  # thousands separators: 1,000 -> 1000
    s = _replace_latex(s)
    s = (s.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/")
         .replace("\\pi", "pi").replace("\\infty", "oo").replace("^", "**"))
    s = s.replace("{", "(").replace("}", ")")
    s = re.sub(r"\s+", "", s)
    if re.fullmatch(r"-?\d+\.0*", s):  # 5.0 -> 5
        s = s.split(".")[0]
    return s


# ---------------------------------------------------------------------- equivalence
_ALLOWED_NAMES = {"sqrt", "pi", "oo", "e", "log", "ln", "exp", "sin", "cos", "tan"}
_SAFE_CHARS = re.compile(r"[0-9a-zA-Z+\-*/().\s]*")


def _sympy_safe(s: str) -> bool:
    """Only plain arithmetic with a few known functions, short, without huge powers."""
    if not s or len(s) > 80 or not _SAFE_CHARS.fullmatch(s) or "__" in s:
        return False
    if re.search(r"[a-zA-Z_]\s*\.", s):  # attribute access
        return False
    for name in re.findall(r"[a-zA-Z]+", s):
        if len(name) > 1 and name not in _ALLOWED_NAMES:
            return False
    if s.count("**") > 1 or re.search(r"\*\*\s*\(?\s*-?\d{3,}", s):
        return False
    return True


def _to_sympy(s: str) -> Any:
    import sympy
    from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations

    local = {"ln": sympy.log, "e": sympy.E, "pi": sympy.pi, "oo": sympy.oo}
    return parse_expr(s, local_dict=local, transformations=(*standard_transformations, implicit_multiplication))


def _split_top_level(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


_SMALL_INT = re.compile(r"-?(?:0|[1-9]\d{0,8})")


def _equal_values(a: str, b: str, symbolic: bool = True) -> bool:
    if a == b:
        return True
    if _SMALL_INT.fullmatch(a) and _SMALL_INT.fullmatch(b):
        # two integers below 10^9 (the common case: "5" vs "7"): sympy would find them equal only
        # when they are (their difference is ≥ 1, above its 1e-9 relative tolerance), without the
        # ~0.5 ms of parsing both
        return int(a) == int(b)
    if not (_sympy_safe(a) and _sympy_safe(b)):
        return False
    if not symbolic:
        raise _Symbolic
    try:
        import sympy

        x, y = _to_sympy(a), _to_sympy(b)
        if x == y:
            return True
        if x.is_number and y.is_number:
            dx, dy = complex(sympy.N(x, 30)), complex(sympy.N(y, 30))
            return abs(dx - dy) <= 1e-9 * max(1.0, abs(dy))
        return sympy.simplify(x - y) == 0
    except Exception:  # noqa: BLE001 - unparsable answers are simply not equal
        return False


def is_equiv(given: str, expected: str, *, symbolic: bool = True) -> bool:
    """True when `given` and `expected` denote the same value (see the module docstring); `symbolic=False`: raise
    `_Symbolic` where sympy would be needed."""
    a, b = _normalize(given), _normalize(expected)
    if not a or not b:
        return False
    if a.lower() == b.lower():
        return True
    pa, pb = _split_top_level(a), _split_top_level(b)
    if len(pa) > 1 and len(pa) == len(pb):  # tuples / lists of solutions, in any order
        remaining = list(pb)
        for p in pa:
            match = next((q for q in remaining if _equal_values(p, q, symbolic)), None)
            if match is None:
                return False
            remaining.remove(match)
        return True
    return _equal_values(a, b, symbolic)
