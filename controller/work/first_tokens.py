"""Time to first token of the model calls, measured on the node daemons for the calls they stream
(`agents/daemon/llmgate.py`, `TrackedLLM.streams`) and carried in each trajectory's turns (`Turn.firstTokenSeconds`).

`node_calls.NodeCalls._results` and `_beat` hand a node's reported results to `FirstTokens.observe_all` (every result, those dropped too: the
calls happened); `Collector` serves the sums as the histogram `rolloutd_model_time_to_first_token_seconds`, no label
(no job, node or backend: the cardinality stays one family), registered by `api.create_app`.
Next step: a per-backend split, once the backends are a bounded set worth a label.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client.core import HistogramMetricFamily

BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class FirstTokens:
    """The counts per bucket (the last one +Inf), their sum: a histogram kept without a registry of its own."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0.0

    def add(self, seconds: float) -> None:
        self.counts[bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def observe_all(self, results: list[Any]) -> None:
        """The trajectories of a node's reported results (`crds.node.Result`)."""
        for res in results:
            self.observe(res.trajectory)

    def observe(self, trajectory: Any) -> None:
        """Each turn's time to first token, of the trajectory's flat turns and of its segments'."""
        for turn in trajectory.turns:
            if turn.first_token_seconds is not None:
                self.add(turn.first_token_seconds)
        for seg in trajectory.segments:
            for turn in seg.turns:
                if turn.first_token_seconds is not None:
                    self.add(turn.first_token_seconds)


class Collector:
    def __init__(self, first_tokens: FirstTokens) -> None:
        self.first_tokens = first_tokens

    def collect(self):
        ft, running, buckets = self.first_tokens, 0, []
        for bound, n in zip((*BUCKETS, float("inf")), ft.counts):
            running += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        yield HistogramMetricFamily("rolloutd_model_time_to_first_token_seconds", "Model calls' time to first token, "
                                    "measured on the node daemons (streamed calls) and reported in the trajectories",
                                    buckets=buckets, sum_value=ft.total)
