#!/usr/bin/env bash
# verl 0.9 GRPO with rolloutd as the rollout: the lines marked "rolloutd" are the whole integration; the rest is
# an ordinary verl run (GPU nodes; not run on the CPU machine this repository is tested on).
set -euo pipefail
export ROLLOUTD_SERVER=https://rolloutd.example:8443 ROLLOUTD_TOKEN_FILE=$HOME/.config/rolloutd/token
export ROLLOUTD_JOB=verl-math                                                         # rolloutd
rolloutctl apply -f examples/verl/job.yaml                                            # rolloutd
python examples/verl/prepare_data.py /shared/data/math/train.jsonl /shared/data/math/verl-train.parquet
python -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files=/shared/data/math/verl-train.parquet \
  data.val_files=/shared/data/math/verl-train.parquet \
  data.train_batch_size=64 data.max_prompt_length=1024 data.max_response_length=4096 \
  data.return_raw_chat=True \
  actor_rollout_ref.model.path=/shared/models/Qwen2.5-3B-Instruct \
  actor_rollout_ref.rollout.name=vllm \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.calculate_log_probs=True \
  actor_rollout_ref.rollout.agent.agent_loop_config_path=examples/verl/agent_loops.yaml \
  +actor_rollout_ref.rollout.checkpoint_manager_class=rolloutd.integrations.verl.checkpoint.RolloutdCheckpointManager \
  trainer.val_before_train=False trainer.n_gpus_per_node=8 trainer.nnodes=1 "$@"
