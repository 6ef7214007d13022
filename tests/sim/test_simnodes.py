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
