"""The trajectory record: what a node daemon reports for one rollout and a trainer receives.

Produced by the agent loop (`rolloutd.agents`), stored by the controller, streamed to trainers.
Token-exact: `token_ids` are the ids the engine was fed or generated, never a re-tokenization. An agent
that rewrote its history (a harness) leaves several sequences: `segments`, the flat fields empty.
"""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field, model_validator

from .base import Model
from .errors import FailureKind  # noqa: F401 - defined with the taxonomy, a field here


class Failure(Model):
    kind: FailureKind = FailureKind.none
    reason: str = ""


class Turn(Model):
    """One assistant turn: half-open slices [start, end) into `Trajectory.token_ids`."""

    generated_start: int
    generated_end: int
    observation_start: int | None = None
    observation_end: int | None = None
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    started: float | None = Field(default=None, description="epoch seconds its model call began (the web UI's "
                                                            "waterfall places the turn with it)")
    model_seconds: float | None = Field(default=None, description="its model call, start to end")
    first_token_seconds: float | None = Field(default=None, ge=0, description=(
        "its model call's time to first token: from the request to the first generated token arriving on the node "
        "(streamed); None when not measured: in drain mode a call is one plain request, but for the first calls to an "
        "engine and one in 64 of the job's on each node, streamed to be timed"))
    tool_seconds: float | None = Field(default=None, description="its tool calls in the sandbox, together")


class Timings(Model):
    """Seconds per stage, plus wall-clock stamps (epoch seconds) of each stage's start and the end:
    `stamps = {"init": t0, "run": t1, "eval": t2, "end": t3}` shows how stages overlapped on a node."""

    queue: float = 0.0
    init: float = 0.0
    run: float = 0.0
    eval: float = 0.0
    stamps: dict[str, float] = Field(default_factory=dict)


# a policy version as a trainer announces it and a node reports it: an int64 or a short text (a step, a checkpoint's
# hash). Bounded because it is indexed: PostgreSQL refused a trajectory whose version's text outgrew an index row,
# at every retry of its results call (its job stalled); 128 characters stay within one even if each is escaped
MAX_VERSION_CHARS = 128


def _bounded_version(v: int | str) -> int | str:
    if isinstance(v, str) and len(v) > MAX_VERSION_CHARS or isinstance(v, int) and not -(1 << 63) <= v < 1 << 63:
        raise ValueError(f"a policy version is an integer within ±2^63 or a text of at most {MAX_VERSION_CHARS} "
                         "characters")
    return v


PolicyVersion = Annotated[int | str, AfterValidator(_bounded_version)]


class VersionSpan(Model):
    """A run of generated tokens sampled by one policy version: positions [start, end) of the sequence's
    `tokenIds` (absolute, like `Turn.generatedStart`). A turn whose weights changed mid-generation has two or
    more spans; each token's logprob is the one its own version sampled with."""

    version: PolicyVersion | None = Field(description="the policy version the backend ran when it sampled these tokens")
    start: int = Field(ge=0)
    end: int = Field(ge=0)


def _check_spans(spans: list[VersionSpan], n: int) -> None:
    last = 0
    for s in spans:
        if not last <= s.start < s.end <= n:
            raise ValueError(f"versionSpans: [{s.start}, {s.end}) is empty, overlaps the span before it or lies "
                             f"beyond the {n} token ids")
        last = s.end


def _check_aligned(ids: list[int], mask: list[int], logprobs: list) -> None:
    n = len(ids)
    if mask and len(mask) != n:
        raise ValueError(f"lossMask has {len(mask)} entries, tokenIds has {n}")
    if logprobs and len(logprobs) != n:
        raise ValueError(f"logprobs has {len(logprobs)} entries, tokenIds has {n}")


_SPANS = ("run-length policy versions of the generated tokens, in order: each span [start, end) of tokenIds "
          "was sampled by `version` (a turn the weights changed in holds several); empty when not recorded")


class Segment(Model):
    """One token sequence of a trajectory whose agent rewrote its history (a harness that summarised or
    truncated its conversation): the fields mean what the trajectory's flat fields of the same name mean."""

    model_config = ConfigDict(allow_inf_nan=True)

    token_ids: list[int] = Field(default_factory=list, description="prompt ids, then generated and context ids")
    prompt_length: int = Field(default=0, description="ids before the first generated id")
    loss_mask: list[int] = Field(default_factory=list, description="1 on generated ids, 0 on the rest")
    logprobs: list[float | None] = Field(default_factory=list, description="sampling logprob of each generated id")
    turns: list[Turn] = Field(default_factory=list)
    calls: int = Field(default=0, description="LLM calls this sequence holds")
    drift: bool = Field(default=False, description="started because a re-tokenized history no longer matched the "
                        "recorded ids (the text was kept), not because the agent rewrote it")
    version_spans: list[VersionSpan] = Field(default_factory=list, description=_SPANS)

    @model_validator(mode="after")
    def _aligned(self) -> "Segment":
        _check_aligned(self.token_ids, self.loss_mask, self.logprobs)
        _check_spans(self.version_spans, len(self.token_ids))
        return self


class Trajectory(Model):
    # A daemon's report is accepted whole: a -inf logprob (a token the engine's processing masked) must
    # not make the controller refuse, and so lose, a finished rollout. Specs are strict (crds.base).
    model_config = ConfigDict(allow_inf_nan=True)

    job: str
    prompt: int = Field(description="index of the prompt in the dataset")
    sample: int = Field(description="sample index within the prompt's group")
    group: int | None = Field(default=None, description="batch mode: the group's id (a prompt may recur across batches)")
    task_id: str | None = None
    token_ids: list[int] = Field(default_factory=list)
    prompt_length: int = 0
    loss_mask: list[int] = Field(default_factory=list)
    logprobs: list[float | None] = Field(default_factory=list)
    turns: list[Turn] = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    reward: float | None = None
    reward_details: dict[str, Any] = Field(default_factory=dict)
    failure: Failure = Field(default_factory=Failure)
    finish_reason: str | None = None
    policy_version: PolicyVersion | None = None
    policy_versions: list[PolicyVersion] = Field(default_factory=list)
    version_spans: list[VersionSpan] = Field(default_factory=list, description=_SPANS)
    admitted_version: PolicyVersion | None = Field(default=None, description="the job's policy version when the "
                                               "rollout was leased (its staleness counts from here)")
    backend: str | None = None
    node: str | None = None
    attempt: int = 0
    attempt_id: str | None = Field(default=None, max_length=200, description=(
        "the attempt's lease id (set by the controller): its node's log lines name it"))
    trace_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$", description=(
        "the W3C trace id of the attempt's trace (set by the controller when tracing is on): the web UI links it "
        "to ROLLOUTD_TRACE_URL"))
    timings: Timings = Field(default_factory=Timings)
    metrics: dict[str, Any] = Field(default_factory=dict)
    segments: list[Segment] = Field(default_factory=list, description=(
        "several token sequences (the agent rewrote its history): each one here, tokenIds/lossMask/logprobs/"
        "turns left empty; empty when the trajectory is one sequence (the flat fields)"))

    @model_validator(mode="after")
    def _aligned(self) -> "Trajectory":
        _check_aligned(self.token_ids, self.loss_mask, self.logprobs)
        _check_spans(self.version_spans, len(self.token_ids))
        if self.segments and self.token_ids:
            raise ValueError("a trajectory holds its tokens in tokenIds or, when there are several sequences, "
                             "in segments, not both")
        if self.failure.kind in (FailureKind.infra, FailureKind.config) and self.reward is not None:
            raise ValueError(f"a failure of kind {self.failure.kind.value} carries no reward (it is not the policy's)")
        return self
