"""Checks of the trainer math (examples/rl/grpo.py), run with the engine venv's Python by
test_grpo.py (the main venv has no torch). Prints OK at the end."""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from rl import grpo  # noqa: E402

# advantages: zero-mean, unit-ish scale per group; an all-equal group gives zeros
a = grpo.group_advantages([1, 0, 0, 1])
assert abs(sum(a)) < 1e-9 and all(abs(abs(x) - 1) < 1e-3 for x in a), a
assert grpo.group_advantages([1, 1, 1]) == [0.0, 0.0, 0.0]

# rows: padding, masks, uninformative and infra-failed samples left out
def traj(ids, plen, lps, reward):
    return {"tokenIds": ids, "promptLength": plen, "lossMask": [0] * plen + [1] * (len(ids) - plen),
            "logprobs": [None] * plen + lps, "reward": reward, "policyVersion": 3}
groups = [
    {"group": 1, "samples": [traj([5, 6, 7], 2, [-0.5], 1.0), traj([5, 6, 8, 9], 2, [-1.0, -2.0], 0.0),
                             traj([5, 6, 1], 2, [-0.1], None)]},
    {"group": 2, "samples": [traj([5, 6, 7], 2, [-0.5], 1.0), traj([5, 6, 7], 2, [-0.5], 1.0)]},
]
rows = grpo.rows_from_groups(groups, pad_id=0)
assert rows.info == {"groups": 2, "informative_groups": 1}
assert rows.input_ids.tolist() == [[5, 6, 7, 0], [5, 6, 8, 9]]
assert rows.attention_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
assert rows.loss_mask.tolist() == [[0, 0, 1, 0], [0, 0, 1, 1]]
assert rows.old_logprobs.tolist() == [[0, 0, -0.5, 0], [0, 0, -1.0, -2.0]]
assert rows.advantages[0] > 0 > rows.advantages[1] and rows.tokens == 3 and rows.policy_versions == [3, 3]
bad = traj([5, 6, 7], 2, [-0.5], 1.0)
bad["lossMask"] = [1, 0, 1]
try:
    grpo.rows_from_groups([{"samples": [bad, traj([5, 6, 8], 2, [-1.0], 0.0)]}])
    raise AssertionError("a mask over prompt tokens must be refused")
except ValueError:
    pass

# loss: ratio 1 → -mean(A) over masked tokens; clipping bounds the ratio's effect; padding ignored
old = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, -2.0, -2.0]])
mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
adv = torch.tensor([1.0, -1.0])
new = old.clone().requires_grad_(True)
loss, st = grpo.clipped_pg_loss(new, old, adv, mask)
assert math.isclose(loss.item(), -(2 * 1.0 + 3 * -1.0) / 5, rel_tol=1e-6), loss.item()
loss.backward()
assert new.grad[0, 2] == 0 and st["ratio_min"] == st["ratio_max"] == 1.0
# a ratio far above 1 + clip on a positive advantage: clipped, no gradient through it
new2 = (old + torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])).requires_grad_(True)
loss2, st2 = grpo.clipped_pg_loss(new2, old, adv, mask)
loss2.backward()
assert new2.grad[0, 0] == 0 and new2.grad[0, 1] != 0 and st2["clipped_frac"] > 0
# token-level: denom = the whole batch's token count when micro-batching
l_half, _ = grpo.clipped_pg_loss(old[:1], old[:1], adv[:1], mask[:1], denom=5)
assert math.isclose(l_half.item(), -2 / 5, rel_tol=1e-6)

# a real model: one step on the tiny model changes weights but not the frozen embeddings; saved
# file has HF names; trainer logprobs equal the behaviour logprobs before the step (ratio 1)
model_dir = Path(sys.argv[1])
model = grpo.load_policy(model_dir, threads=1)
emb0 = model.get_input_embeddings().weight.detach().clone()
w0 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
ids = torch.tensor([[1, 5, 9, 12, 7, 3], [1, 5, 9, 4, 0, 0]])
attn = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
with torch.no_grad():
    lp = grpo.token_logprobs(model, ids, attn)
lmask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 0, 0]], dtype=torch.float)
with torch.no_grad():  # the LM head on masked positions only: the same numbers there
    lp_masked = grpo.token_logprobs(model, ids, attn, lmask[:, 1:])
assert torch.allclose(lp_masked, lp * lmask[:, 1:], atol=1e-6) and lp_masked[0, 0] == 0
old_full = torch.zeros(2, 6)
old_full[:, 1:] = lp * lmask[:, 1:]
r = grpo.Rows(ids, attn, lmask, old_full, torch.tensor([1.0, -1.0]), torch.tensor([1.0, 0.0]), [0, 0], [0, 0])
opt = grpo.make_optimizer(model, lr=1e-3)
st = grpo.train_step(model, opt, r, micro_batch=1)
assert math.isfinite(st["loss"]) and st["tokens"] == 4 and st["logprob_diff_max"] < 1e-5, st
assert torch.equal(model.get_input_embeddings().weight, emb0)
assert any(not torch.equal(p, w0[n]) for n, p in model.named_parameters() if p.requires_grad)
import tempfile  # noqa: E402

from safetensors.torch import load_file  # noqa: E402

with tempfile.TemporaryDirectory() as d:
    grpo.save_weights(model, d)
    saved = load_file(str(Path(d) / "model.safetensors"))
    assert set(saved) == set(model.state_dict()) or "lm_head.weight" not in saved
    assert torch.equal(saved["model.layers.0.mlp.up_proj.weight"], model.state_dict()["model.layers.0.mlp.up_proj.weight"])
print("OK")
