"""The scale benchmark's bookkeeping (tests/support/sim/simnodes.py): what the controller accepted from the simulated
nodes against what it delivers. A wrong audit would let a lost or duplicated rollout pass unseen."""
import pytest

from support.sim.ledger import Ledger, audit


def ledger_with(*accepted: tuple[str, int, int]) -> Ledger:
    led = Ledger()
    for aid, prompt, sample in accepted:
        led.leased(aid, prompt, sample)
    led.acked([aid for aid, _, _ in accepted], {})
    return led


def test_exactly_once_passes():
    led = ledger_with(("1.1.a", 0, 0), ("2.1.b", 0, 1), ("3.1.c", 1, 0))
    result = audit(led.accepted, [(0, 1), (1, 0), (0, 0)])
    assert result.ok
    assert (result.accepted, result.delivered) == (3, 3)


def test_accepted_but_not_delivered_is_lost():
    led = ledger_with(("1.1.a", 0, 0), ("2.1.b", 0, 1))
    result = audit(led.accepted, [(0, 0)])
    assert result.lost == [(0, 1)] and not result.ok


def test_delivered_twice_is_a_duplicate():
    led = ledger_with(("1.1.a", 0, 0))
    result = audit(led.accepted, [(0, 0), (0, 0)])
    assert result.duplicated == [(0, 0)] and not result.lost


def test_two_attempts_of_one_item_accepted_is_a_duplicate():
    led = ledger_with(("1.1.a", 0, 0), ("1.2.b", 0, 0))  # the expired attempt's late result also accepted
    result = audit(led.accepted, [(0, 0)])
    assert result.duplicated == [(0, 0)]


def test_delivered_without_an_accepted_result_is_a_phantom():
    led = ledger_with(("1.1.a", 0, 0))
    result = audit(led.accepted, [(0, 0), (3, 2)])
    assert result.phantom == [(3, 2)] and not result.ok


def test_a_finished_job_must_deliver_every_expected_rollout():
    led = ledger_with(("1.1.a", 0, 0))
    assert audit(led.accepted, [(0, 0)]).ok
    assert audit(led.accepted, [(0, 0)], expected={(0, 0), (0, 1)}).lost == [(0, 1)]


def test_dropped_results_are_not_counted_as_accepted():
    led = Ledger()
    led.leased("1.1.a", 0, 0)
    led.leased("1.2.b", 0, 0)
    led.acked(["1.2.b"], {"1.1.a": "stale attempt"})
    assert led.accepted == [(0, 0)] and led.dropped == {"1.1.a": "stale attempt"}
    assert audit(led.accepted, [(0, 0)]).ok


def test_an_ack_for_an_attempt_never_leased_is_an_error():
    with pytest.raises(KeyError):
        Ledger().acked(["9.1.z"], {})


def _shard(**cfg):
    from support.sim.simnodes import Shard

    base = {"job": "j", "slots": 4, "nodes": 1, "time_factor": 0.25, "url": "http://127.0.0.1:1", "credential": "x",
            "median_seconds": 40.0, "sigma": 0.0}
    return Shard({**base, **cfg})


def test_a_slow_time_factor_stretches_the_rollouts_and_by_default_the_protocol_too():
    shard = _shard()
    assert shard.duration() == 160.0  # 40 s / 0.25
    plain = _shard(time_factor=1.0)
    assert shard.pace == 0.25  # a beat interval the controller answers in simulated seconds, stretched 4×
    assert shard.min_gap(120.0) == pytest.approx(plain.min_gap(30.0) / 0.25)
    assert shard.coalesce(30.0) == pytest.approx(plain.coalesce(30.0) / 0.25)


def test_durations_only_keeps_the_daemons_pace_real():
    shard = _shard(durations_only=True)
    assert shard.duration() == 160.0
    assert shard.pace == 1.0
    plain = _shard(time_factor=1.0)
    assert shard.min_gap(30.0) == plain.min_gap(30.0) and shard.coalesce(30.0) == plain.coalesce(30.0)
