"""The engine-busy benchmark's own logic (tests/support/sim/engine_replay.py, the baseline of bench engine_busy): the replay must send the engine exactly the
prompts and turn lengths rolloutd sent (tool outputs included), and the busy window and slot split must add up.
A wrong replay would compare rolloutd against different work."""

from support.sim.engine_replay import busy_stats, replay_plan, slot_budget
from rolloutd.crds.trajectory import Trajectory, Turn


def conversation(prompt: int, first: list[int], turns: list[tuple[list[int], list[int]]]) -> dict:
    """A trajectory as the API returns it: the first prompt, then per turn generated ids and observation ids."""
    ids, records = list(first), []
    for gen, obs in turns:
        start = len(ids)
        ids += gen
        record = Turn(generated_start=start, generated_end=len(ids))
        if obs:
            record.observation_start = len(ids)
            ids += obs
            record.observation_end = len(ids)
        records.append(record)
    return Trajectory(job="j", prompt=prompt, sample=0, token_ids=ids, prompt_length=len(first), turns=records,
                      loss_mask=[0] * len(ids)).wire()


def test_each_turn_replays_everything_before_its_generated_ids():
    t = conversation(0, [1, 2, 3], [([10, 11], [90, 91, 92]), ([12, 13, 14], [93]), ([15], [])])
    plan = replay_plan([t])
    assert plan == [[
        {"prompt_ids": [1, 2, 3], "max_tokens": 2, "seed": 0},
        {"prompt_ids": [1, 2, 3, 10, 11, 90, 91, 92], "max_tokens": 3, "seed": 1},   # the tool output included
        {"prompt_ids": [1, 2, 3, 10, 11, 90, 91, 92, 12, 13, 14, 93], "max_tokens": 1, "seed": 2},
    ]]


def test_conversations_come_in_prompt_order_and_stay_apart():
    a = conversation(1, [5], [([6], [7])])
    b = conversation(0, [8, 8], [([9, 9], [])])
    plan = replay_plan([a, b])
    assert [[turn["prompt_ids"] for turn in c] for c in plan] == [[[8, 8]], [[5]]]


def test_busy_window_runs_from_first_to_last_running_sample():
    samples = [(0.0, 0), (1.0, 2), (2.0, 0), (3.0, 4), (4.0, 1), (5.0, 0)]
    got = busy_stats(samples)
    assert (got["start"], got["end"], got["window"]) == (1.0, 4.0, 3.0)
    assert got["busy"] == 0.75 and got["mean_running"] == 7 / 4
    assert busy_stats([(0.0, 0), (1.0, 0)])["window"] == 0.0


def test_slot_split_accounts_for_every_slot_second():
    # one rollout in RUN over [0, 1): a turn in flight [0.1, 0.4), a tool call, a turn [0.5, 0.8); C = 2
    t = {"timings": {"stamps": {"run": 0.0}, "run": 1.0},
         "metrics": {"turn_stamps": [[0.1, 0.4, 0.45], [0.5, 0.8, 0.85]]}}
    got = slot_budget([t], 2, 0.0, 1.0, step=0.001)
    assert abs(got["generating"] - 0.6) < 0.01
    assert abs(got["between_turns"] - 0.1) < 0.01
    assert abs(got["run_outside_turns"] - 0.3) < 0.01
    assert abs(got["no_rollout_in_run"] - 1.0) < 0.01
    assert abs(sum(got.values()) - 2.0) < 0.01
