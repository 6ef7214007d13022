"""The states an item, a registered node daemon, a batch group and a batch go through (the SQL values).

Written by `queue` (items), `nodes` (daemons) and `batches` (groups, batches); `tables` stores them as text.
"""
from __future__ import annotations

from enum import StrEnum


class ItemState(StrEnum):
    """queued → leased (to one attempt of one daemon) → done | failed | cancelled; an expired or
    failed lease goes back to queued."""
    queued = "queued"
    leased = "leased"
    done = "done"
    failed = "failed"
    cancelled = "cancelled"


LIVE = (ItemState.queued, ItemState.leased)  # an item still to run or running


class DaemonState(StrEnum):
    """A registered node daemon (not the executor's view of a node, `executors/base.NodeState`)."""
    active = "active"
    draining = "draining"  # finishes its leases, takes no new ones
    gone = "gone"  # deregistered or silent too long: its calls are refused


class GroupState(StrEnum):
    running = "running"
    counted = "counted"
    uninformative = "uninformative"
    incomplete = "incomplete"  # a sample failed for infrastructure reasons
    cancelled = "cancelled"


class BatchState(StrEnum):
    running = "running"
    complete = "complete"
    failed = "failed"
