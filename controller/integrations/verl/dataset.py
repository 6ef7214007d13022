"""A rolloutd job's dataset rows as verl's dataset rows (RLHFDataset's parquet columns): each row keeps its
rolloutd prompt index in `extra_info.index` and selects the "rolloutd" agent loop.

Where it sits: examples/verl/prepare_data.py writes the parquet verl reads; the agent loop reads the index back.
"""
from __future__ import annotations

from typing import Any, Sequence


def to_verl_rows(rows: Sequence[dict[str, Any]], *, question_key: str = "question", answer_key: str = "answer",
                 data_source: str = "rolloutd") -> list[dict[str, Any]]:
    """Row i of the job's dataset → verl's row with `extra_info.index` = i and `agent_name` = "rolloutd". The
    prompt text is for verl's own bookkeeping (raw_prompt, logging): the trained ids are the trajectory's."""
    out = []
    for i, row in enumerate(rows):
        if question_key not in row:
            raise KeyError(f"row {i} has no {question_key!r}")
        out.append({"data_source": data_source, "agent_name": "rolloutd",
                    "prompt": [{"role": "user", "content": str(row[question_key])}],
                    "reward_model": {"style": "rolloutd", "ground_truth": str(row.get(answer_key, ""))},
                    "extra_info": {"index": i, "id": str(row.get("id", i))}})
    return out
