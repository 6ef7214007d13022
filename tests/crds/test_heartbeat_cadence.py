"""The beat cadence the controller gives a job's daemons (crds.node): production's 0.5 s for a small
job, slower beats for a big one so the controller's load stays bounded, never so slow a lease lapses."""
import pytest

from rolloutd.crds.node import heartbeat_min_gap, heartbeat_seconds


def test_a_small_job_beats_every_half_second():
    assert heartbeat_seconds(1, 30.0) == 0.5
    assert heartbeat_seconds(50, 30.0) == 0.5
    assert heartbeat_min_gap(0.5) == 0.1


def test_a_big_job_beats_less_often_as_it_grows():
    assert heartbeat_seconds(300, 30.0) == 1.5
    assert heartbeat_seconds(1000, 30.0) == 5.0
    assert heartbeat_seconds(300, 30.0) < heartbeat_seconds(600, 30.0)


def test_a_lease_outlives_several_beats():
    assert heartbeat_seconds(4000, 30.0) == 5.0  # a sixth of the lease, however big the job
    assert heartbeat_seconds(1, 1.2) == pytest.approx(0.2)  # a short lease beats faster than the default


def test_stage_change_beats_are_coalesced_over_a_fifth_of_the_interval():
    assert heartbeat_min_gap(5.0) == 1.0
    assert heartbeat_min_gap(0.1) == 0.05  # never closer than 50 ms
