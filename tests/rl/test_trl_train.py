"""TRL's GRPOTrainer trains through rolloutd for 2 steps on the tiny model (examples/trl/train_trl.py in
the trainer venv): weights change, every trajectory carries the version TRL holds, the sequences
TRL's loss sees are rolloutd's token ids, vLLM (reloaded each step) agrees with TRL's logprobs.
Rewards are scripted (tests/e2e/plugins: reward = sample % 2): the random tiny model is never right."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rolloutd.agents.engine.model_dirs import model_dir

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "tests" / "e2e" / "plugins"
TRL_PY = Path(os.environ.get("ROLLOUTD_HOME") or Path.home() / ".cache" / "rolloutd") / "trl" / "venv" / "bin" / "python"


def trainer_venv_ready() -> str:
    if not TRL_PY.exists():
        return f"no trainer venv at {TRL_PY} (`make trl-venv`, part of `make setup`, creates it)"
    r = subprocess.run([str(TRL_PY), "-c", "import trl, torch"], capture_output=True, text=True)
    return "" if r.returncode == 0 else f"the trainer venv {TRL_PY} lacks trl/torch: {r.stderr[-300:]}"


def test_grpo_trainer_two_steps_through_rolloutd(tmp_path, tiny_engine):
    reason = trainer_venv_ready()
    if reason:
        pytest.skip(reason)
    source = tmp_path / "mixed.jsonl"
    source.write_text("".join(json.dumps({"id": f"m{i}", "question": f"What is {i} + 1?", "answer": str(i + 1),
                                          "script": "mixed"}) + "\n" for i in range(6)))
    out, name = tmp_path / "out", "trl-test"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    p = subprocess.run(
        [str(TRL_PY), str(REPO / "examples" / "trl" / "train_trl.py"), "--model", "tiny", "--engine-url",
         tiny_engine.url, "--kind", "scripted", "--train", str(source), "--heldout", "", "--controller-env",
         str(PLUGINS), "--steps", "2", "--groups", "2", "--samples", "2", "--max-tokens", "6", "--lr", "1e-2",
         "--threads", "1", "--name", name, "--out", str(out), "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    s = json.loads((out / "summary.json").read_text())
    first, second = s["steps"]
    # TRL trained on exactly rolloutd's sequences, scored by rolloutd (reward = sample % 2: 0.5 mean)
    assert first["trained_ids_equal_rolloutd"] and second["trained_ids_equal_rolloutd"]
    assert first["samples_scored"] == 4 and first["reward_mean"] == 0.5 and first["infra_failures"] == 0
    # version tags: batch 1 by the untrained policy (0), batch 2 by version 1, which TRL held
    assert (first["batch_policy_versions"], second["batch_policy_versions"]) == ("0", "1")
    assert first["stale_samples"] == second["stale_samples"] == 0 and s["final_version"] == 2
    assert first["reloaded"] and second["reloaded"]
    # fp32 both: TRL's logprobs of the trained tokens equal vLLM's, also after the first update
    # (lr 1e-2: a backend left on the old weights would be far off)
    assert first["logprob_diff_max"] < 1e-3 and second["logprob_diff_max"] < 1e-3, (first, second)
    # the weights changed (the last saved version differs from the model the engine started with)
    check = ("import sys; from safetensors.torch import load_file; from pathlib import Path; "
             "a = load_file(sys.argv[1] + '/model.safetensors'); b = load_file(next(Path(sys.argv[2]).glob('*.safetensors')));"
             "print(sum(int(not (a[k] == b[k]).all()) for k in a if k in b), len(a))")
    r = subprocess.run([str(TRL_PY), "-c", check, s["weights"], str(model_dir("tiny"))], capture_output=True, text=True)
    changed, total = map(int, r.stdout.split())
    assert 0 < changed < total, (changed, total, r.stderr[-2000:])  # trained, but the frozen embedding is not
    assert (out / "reward.png").stat().st_size > 0
    shutil.rmtree(Path(s["weights"]).parent, ignore_errors=True)
