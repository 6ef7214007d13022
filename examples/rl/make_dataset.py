"""Writes examples/rl/add1-train.jsonl and add1-heldout.jsonl (single-digit addition).

All 100 pairs (a, b) with a, b in 0..9, shuffled with a fixed seed; 20 pairs are held out (never
trained on) for the before/after evaluation, 80 are the training prompts (rolloutd opens them in
file order, cycling, so the shuffle spreads easy and hard ones over the batches).
Rows are `kind: math` tasks: reward 1 when the last `\\boxed{}`, else the bare reply, else the
last number in the reply equals a + b (agents/tasks/math.py). Run it again: same files.
"""
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUESTION = "What is {a} + {b}? Answer with just the number."


def rows() -> tuple[list[dict], list[dict]]:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(8).shuffle(pairs)
    def row(split: str, i: int, a: int, b: int) -> dict:
        return {"id": f"add1-{split}-{i:03d}", "question": QUESTION.format(a=a, b=b), "answer": str(a + b)}
    heldout = [row("heldout", i, a, b) for i, (a, b) in enumerate(pairs[:20])]
    train = [row("train", i, a, b) for i, (a, b) in enumerate(pairs[20:])]
    return train, heldout


if __name__ == "__main__":
    train, heldout = rows()
    for name, data in (("add1-train.jsonl", train), ("add1-heldout.jsonl", heldout)):
        (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in data))
        print(f"{HERE / name}: {len(data)} prompts")
