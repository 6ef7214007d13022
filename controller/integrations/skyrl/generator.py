"""SkyRL's generator served by a rolloutd batch job: SkyRL picks the prompts (n copies each), rolloutd runs
them as one batch of groups and the trajectories come back as SkyRL's `GeneratorOutput`, token for token.

Where it sits: in SkyRL's trainer (the trainer's own venv, `pip install 'rolloutd[skyrl]'`), passed as the
trainer's `generator`; `samples.GroupSource` fetches the groups and replaces infrastructure failures.
"""
from __future__ import annotations

import sys
from typing import Sequence

if sys.version_info < (3, 12):
    # skyrl 0.2-0.3 declares a pydantic model field with typing.TypedDict (skyrl/tinker/types.py), which pydantic
    # refuses before Python 3.12, so `import skyrl.train…` fails on 3.11. typing_extensions' TypedDict is the
    # one pydantic accepts; it must be in place before skyrl's modules are first imported.
    import typing

    import typing_extensions

    if "skyrl.tinker.types" not in sys.modules:
        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput, TrajectoryID

from rolloutd.client import AsyncRolloutClient

from ..samples import GroupSource, Sample, split


def to_generator_output(samples: Sequence[Sample], trajectory_ids: Sequence[TrajectoryID] | None) -> GeneratorOutput:
    """Samples (in SkyRL's input order) as SkyRL's output: prompt ids, response ids, the scalar reward, loss masks
    (1 on generated tokens, 0 on tool observations), rolloutd's stop reason and the engine's logprobs."""
    rewards = [s.reward for s in samples]
    return GeneratorOutput(
        prompt_token_ids=[s.prompt_ids for s in samples], response_ids=[s.response_ids for s in samples],
        rewards=rewards, loss_masks=[s.response_mask for s in samples],
        stop_reasons=[s.finish_reason for s in samples], rollout_logprobs=[s.logprobs for s in samples],
        trajectory_ids=list(trajectory_ids) if trajectory_ids is not None else None,
        rollout_metrics={"rolloutd/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0},
        trajectory_generation_times=None, rollout_expert_indices=None, is_last_step=None,
        env_metrics=[{"rolloutd_trajectory": s.key, "rolloutd_versions": s.versions} for s in samples],
        pixel_values=None, image_grid_thw=None)


class RolloutdGenerator(GeneratorInterface):
    """SkyRL asks for n copies of each prompt in a row (`prepare_generator_input`: `trajectory_ids` with one
    `instance_id` per prompt, `repetition_id` 0..n-1). A prompt's rolloutd index is its `env_extras[prompt_key]`
    (default "index": the row's position in the job's dataset). All distinct prompts go to rolloutd as one batch;
    repetition i gets the group's i-th usable sample. Infra failures never reach SkyRL: they are replaced by
    usable samples of fresh groups of the same prompt, or `NoUsableSample` is raised (never a reward 0)."""

    def __init__(self, client: AsyncRolloutClient, job: str, *, prompt_key: str = "index", max_replacements: int = 2,
                 timeout: float = 3600.0):
        self.source = GroupSource(client, job, max_replacements=max_replacements, timeout=timeout)
        self.prompt_key = prompt_key

    async def generate(self, input_batch: GeneratorInput) -> GeneratorOutput:
        extras = input_batch.get("env_extras") or []
        ids = input_batch.get("trajectory_ids")
        if not ids or len(ids) != len(input_batch["prompts"]) or len(extras) != len(ids):
            raise ValueError("RolloutdGenerator needs trajectory_ids and env_extras for every prompt (SkyRL's "
                             "prepare_generator_input makes both)")
        order: list[str] = []
        index: dict[str, int] = {}
        for tid, extra in zip(ids, extras):
            if self.prompt_key not in (extra or {}):
                raise KeyError(f"env_extras of {tid.instance_id} has no {self.prompt_key!r} (the prompt's index in "
                               f"rolloutjob {self.source.job}'s dataset)")
            p = int(extra[self.prompt_key])
            if index.setdefault(tid.instance_id, p) != p:
                raise ValueError(f"instance {tid.instance_id} maps to prompts {index[tid.instance_id]} and {p}")
            if tid.instance_id not in order:
                order.append(tid.instance_id)
        reps: dict[str, int] = {}
        for tid in ids:
            reps[tid.instance_id] = max(reps.get(tid.instance_id, 0), tid.repetition_id + 1)
        n = max(reps.values())
        groups = dict(zip(order, await self.source.groups([index[i] for i in order], n)))
        samples = [split(groups[tid.instance_id][tid.repetition_id]) for tid in ids]
        return to_generator_output(samples, ids)
