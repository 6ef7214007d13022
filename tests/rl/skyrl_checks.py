"""Run in SkyRL's own venv by test_skyrl_generator.py: SkyRL's trainer code turns real dataset rows into its
training input through `RolloutdGenerator`, up to the advantages; prints it as JSON.

What runs is SkyRL's: PromptDataset + collate_fn (the rows), prepare_generator_input (n copies, trajectory ids),
RayPPOTrainer.generate (our generator, then validate_generator_output), postprocess_generator_output (per-token
rewards), convert_to_training_input (padded tensors) and compute_advantages_and_returns (GRPO). Those trainer
methods are called on a stand-in `self` holding the config, tokenizer and metrics (RayPPOTrainer's constructor
places Ray workers). Not run (CUDA only): the FSDP policy/ref workers (forward, update) and SkyRL's inference
engines.
"""
import argparse
import asyncio
import json
import os
import sys
from types import SimpleNamespace


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--rows", required=True, help="the rolloutd job's dataset (jsonl)")
    p.add_argument("--server", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--n", type=int, default=2)
    a = p.parse_args()

    from rolloutd.integrations.skyrl import RolloutdGenerator  # first: on Python 3.11 it makes skyrl importable

    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.dataset import PromptDataset
    from skyrl.train.generators.utils import prepare_generator_input
    from skyrl.train.trainer import RayPPOTrainer
    from transformers import AutoTokenizer

    from rolloutd.client import AsyncRolloutClient

    rows = [json.loads(line) for line in open(a.rows) if line.strip()]
    data = os.path.join(os.path.dirname(os.path.abspath(a.rows)), "skyrl-train.jsonl")
    with open(data, "w") as f:  # SkyRL's dataset format: the prompt, the env class, the rest is env_extras
        for i, row in enumerate(rows):
            f.write(json.dumps({"prompt": [{"role": "user", "content": row["question"]}], "env_class": "rolloutd",
                                "index": i}) + "\n")
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    ds = PromptDataset([data], tok, max_prompt_length=512, num_workers=1)
    prompts = ds.collate_fn([ds[i] for i in range(len(ds))])
    cfg = SkyRLTrainConfig.from_cli_overrides([
        f"trainer.policy.model.path={a.model_dir}", f"generator.n_samples_per_prompt={a.n}",
        "trainer.algorithm.advantage_estimator=grpo", f"trainer.train_batch_size={len(rows)}",
        f"trainer.policy_mini_batch_size={len(rows)}"])
    gi, uids = prepare_generator_input(prompts, a.n, {}, "rolloutd", "train", 1)
    async with AsyncRolloutClient(a.server, token_file=a.token_file) as client:
        me = SimpleNamespace(cfg=cfg, tokenizer=tok, all_metrics={}, generator=RolloutdGenerator(client, a.job),
                             dispatch=SimpleNamespace(get_lcm_dp_size=lambda: 1))
        out = await RayPPOTrainer.generate(me, gi)
    raw = {k: out[k] for k in ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons",
                               "rollout_logprobs")}
    raw["trajectory_ids"] = [[t.instance_id, t.repetition_id] for t in out["trajectory_ids"]]
    raw["keys"] = [m["rolloutd_trajectory"] for m in out["env_metrics"]]
    out, uids = RayPPOTrainer.postprocess_generator_output(me, out, uids)
    batch = RayPPOTrainer.convert_to_training_input(me, out, uids)
    batch["values"] = None
    batch = RayPPOTrainer.compute_advantages_and_returns(me, batch)
    tensors = {}
    for key in ("sequences", "attention_mask", "response_mask", "loss_mask", "rewards", "rollout_logprobs",
                "advantages"):
        tensors[key] = batch[key].tolist()
    print(json.dumps({"raw": raw, "uids": uids, "tensors": tensors, "env_index": [e["index"] for e in gi["env_extras"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
