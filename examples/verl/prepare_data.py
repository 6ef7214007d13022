"""The rolloutd job's dataset as verl's parquet: row i keeps prompt index i (`extra_info.index`) and selects the
"rolloutd" agent loop. Run it in the verl venv:

    python examples/verl/prepare_data.py /shared/data/math/train.jsonl /shared/data/math/verl-train.parquet
"""
import json
import sys

import pandas as pd

from rolloutd.integrations.verl import to_verl_rows


def main(source: str, target: str) -> None:
    rows = [json.loads(line) for line in open(source) if line.strip()]
    pd.DataFrame(to_verl_rows(rows)).to_parquet(target)
    print(f"{len(rows)} rows -> {target}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
