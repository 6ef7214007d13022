"""Run in verl's own venv by test_verl_agent_loop.py: verl's driver and agent-loop worker code turns real
dataset rows into a training batch through the "rolloutd" agent loop, up to the advantages; prints it as JSON.

What runs is verl's: RLHFDataset + collate_fn (the rows), RayPPOTrainer._get_gen_batch and DataProto.repeat (the
n copies, uid per row), AgentLoopWorker.generate_sequences (agent-loop registry, our loop per row, verl's padding
and _postprocess), then extract_reward and compute_advantage (GRPO). Not run: the FSDP actor/ref workers (old
log-probs, the update) and verl's own vLLM servers, which need CUDA; ray is not started (the worker is built
in-process, as its actor would be).
"""
import argparse
import asyncio
import json
import os
import sys
import uuid

import numpy as np


def config(model_dir: str, data: str, n: int, agent_loops: str):
    from hydra import compose, initialize_config_dir

    import verl.trainer.config as cfg_pkg

    with initialize_config_dir(config_dir=os.path.dirname(cfg_pkg.__file__), version_base=None):
        return compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data}", f"data.val_files={data}",
            "data.max_prompt_length=256", "data.max_response_length=64", "data.train_batch_size=2",
            "data.return_raw_chat=True", f"actor_rollout_ref.rollout.n={n}",
            "actor_rollout_ref.rollout.prompt_length=256", "actor_rollout_ref.rollout.response_length=64",
            "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.rollout.name=vllm",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_loops}",
            "algorithm.adv_estimator=grpo"])


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--rows", required=True, help="the rolloutd job's dataset (jsonl)")
    p.add_argument("--agent-loops", required=True)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--sync-address", default="", help="then: RolloutdCheckpointManager.rolloutd_sync(3) with one "
                   "stand-in replica at this address (job: ROLLOUTD_JOB)")
    a = p.parse_args()

    from torch.utils.data import DataLoader
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage, compute_response_mask
    from verl.trainer.ppo.reward import extract_reward
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    import pandas as pd

    from rolloutd.integrations.verl import to_verl_rows

    rows = [json.loads(line) for line in open(a.rows) if line.strip()]
    data = os.path.join(os.path.dirname(a.agent_loops), "train.parquet")
    pd.DataFrame(to_verl_rows(rows)).to_parquet(data)
    cfg = config(a.model_dir, data, a.n, a.agent_loops)
    worker = AgentLoopWorker(cfg, llm_client=None)
    dataset = RLHFDataset(data_files=[data], tokenizer=worker.tokenizer, config=cfg.data, processor=None)
    rows = next(iter(DataLoader(dataset, batch_size=len(dataset), collate_fn=collate_fn, shuffle=False)))
    batch = DataProto.from_single_dict(rows)
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
    gen = RayPPOTrainer._get_gen_batch(None, batch)
    gen.meta_info["global_steps"] = 1
    gen = gen.repeat(repeat_times=a.n, interleave=True)
    out = await worker.generate_sequences(gen)
    batch = batch.repeat(repeat_times=a.n, interleave=True).union(out)
    if "response_mask" not in batch.batch.keys():
        batch.batch["response_mask"] = compute_response_mask(batch)
    reward, _ = extract_reward(batch)
    batch.batch["token_level_scores"] = batch.batch["token_level_rewards"] = reward
    batch = compute_advantage(batch, adv_estimator=AdvantageEstimator.GRPO, num_repeat=a.n, config=cfg.algorithm)

    b, nt = batch.batch, batch.non_tensor_batch
    rows_out = []
    for i in range(len(batch)):
        attn, rmask = b["attention_mask"][i].bool(), b["response_mask"][i]
        plen = b["prompts"].shape[1]
        resp_len = int(attn[plen:].sum())
        rows_out.append({
            "uid": str(nt["uid"][i]), "index": int(nt["index"][i]), "input_ids": b["input_ids"][i][attn].tolist(),
            "prompt_ids": b["prompts"][i][attn[:plen]].tolist(), "responses": b["responses"][i][:resp_len].tolist(),
            "response_mask": rmask[:resp_len].tolist(), "mask_beyond": int(rmask[resp_len:].sum()),
            "rollout_log_probs": b["rollout_log_probs"][i][:resp_len].tolist(),
            "score": float(b["token_level_scores"][i].sum()),
            "score_at": int(b["token_level_scores"][i].nonzero().flatten().tolist()[-1]) if b["token_level_scores"][i].any() else None,
            "advantage": float(b["advantages"][i][rmask.bool()][0]) if rmask.any() else 0.0,
            "trajectory": nt["rolloutd_trajectory"][i], "versions": list(nt["rolloutd_versions"][i]),
            "min_global_steps": nt["min_global_steps"][i], "max_global_steps": nt["max_global_steps"][i]})
    synced = None
    if a.sync_address:  # verl's checkpoint-manager hook, loaded as verl's driver loads it
        from types import SimpleNamespace

        from verl.utils.import_utils import load_class_from_fqn
        from verl.workers.config.rollout import CheckpointEngineConfig

        cls = load_class_from_fqn("rolloutd.integrations.verl.checkpoint.RolloutdCheckpointManager", "manager")
        manager = cls(config=CheckpointEngineConfig(backend="naive"), actor_wg=None,
                      replicas=[SimpleNamespace(server_address=a.sync_address)])
        synced = manager.rolloutd_sync(3)["policy"]["version"]
    print(json.dumps({"rows": rows_out, "keys": sorted(b.keys()), "synced": synced}))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
