"""What acts in a rollout: the agent (loop, oracle or harness), how it samples, and the LLM it calls.

Part of the RolloutJob spec (`rolloutjob.RolloutJobSpec.agent` and `.llm`, re-exported there); the node's
`agents/daemon/jobconfig.py` turns them into the agent loop's settings, the controller pins `llm.backends`.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .base import Model


# apply_chat_template's own arguments, which rolloutd sets itself: never a template variable of the job's
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                                "padding", "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class SamplingSpec(Model):
    """How the model samples each turn (sent to the backends as vLLM's sampling parameters)."""

    temperature: float = Field(default=1.0, ge=0.0, description="sampling temperature (0: greedy)")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling: keep the smallest set of "
                         "tokens whose probabilities add up to this")
    top_k: int | None = Field(default=None, description="keep only the k most likely tokens; -1 or null disables")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="drop tokens less likely than this "
                                 "fraction of the most likely one")
    max_tokens_per_turn: int = Field(default=256, ge=1, description="tokens the model may generate in one turn")
    max_total_tokens: int = Field(default=2048, ge=1, description="the whole trajectory's budget: prompt, every "
                                  "turn and every tool observation together")
    seed: int | None = Field(default=None, description="sampling seed (the same seed gives the same ids)")
    stop: list[str] = Field(default_factory=list, description="strings that end a turn")
    repetition_penalty: float | None = Field(default=None, gt=0.0, description="vLLM's repetition penalty "
                                              "(1: none)")
    presence_penalty: float | None = Field(default=None, description="OpenAI-style presence penalty")
    frequency_penalty: float | None = Field(default=None, description="OpenAI-style frequency penalty")
    ignore_eos: bool | None = Field(default=None, description="keep generating past the end-of-sequence token "
                                    "(turns of a fixed length: benchmarks and tests)")

    @model_validator(mode="after")
    def _turn_fits(self) -> "SamplingSpec":
        # caught at apply time; a prompt longer than maxTotalTokens is caught by the first rollout
        if self.max_tokens_per_turn > self.max_total_tokens:
            raise ValueError(f"maxTokensPerTurn ({self.max_tokens_per_turn}) is larger than maxTotalTokens "
                             f"({self.max_total_tokens}), which bounds the prompt and every turn together")
        return self


Tool = Literal["bash", "ipython", "editor", "submit"]


AgentKind = Literal["loop", "oracle", "harness"]
LLM_FREE_AGENTS = ("oracle",)  # agent kinds that make no LLM call: `llm` may be omitted


class AgentSpec(Model):
    """Who acts in the sandbox: rolloutd's agent loop, the task's oracle, or a harness of your own."""

    kind: AgentKind = Field(default="loop", description="loop: rolloutd's multi-turn agent loop on `llm`; "
                            "oracle: the task's reference solution (harbor: solution/solve.sh), to validate a task set; "
                            "harness: `command`, a black-box agent calling `llm` through an OpenAI-compatible gateway")
    command: str | None = Field(default=None, validate_default=True,
                                description="harness: the command line run in the sandbox (OPENAI_BASE_URL set, "
                                            "the instruction on stdin and in $ROLLOUTD_INSTRUCTION_FILE)")
    max_turns: int = Field(default=4, ge=1, description="assistant turns per rollout")
    tools: list[Tool] = Field(default_factory=lambda: ["bash", "ipython", "editor", "submit"],
                              description="the tools the agent loop offers the model")
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="how each turn is sampled")
    drift_check: bool = Field(default=False, description="re-tokenize decoded conversations and report drift")
    system_prompt: str | None = Field(default=None, min_length=1, max_length=65536,
                                      description="loop: the conversation's system message, instead of the task "
                                                  "kind's own (which also names the tools and `submit`)")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, max_length=32,
        description="variables for the tokenizer's chat template, passed to every prompt it renders (Qwen3: "
                    "{enable_thinking: false}); each a string, number or boolean")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(set(kwargs) & TEMPLATE_ARGUMENTS)
        if reserved:
            raise ValueError(f"{', '.join(reserved)}: set by rolloutd for every prompt, not a template variable")
        bad = [k for k, v in kwargs.items() if not k.isidentifier() or not isinstance(v, (str, int, float, bool))]
        if bad:
            raise ValueError(f"{', '.join(bad)}: a template variable is a name with a string, a number or a boolean")
        return kwargs

    @field_validator("command")
    @classmethod
    def _command_for_harness(cls, command: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("kind", "loop")
        if kind == "harness" and not (command and command.strip()):
            raise ValueError("agent.kind harness needs agent.command (the harness's command line)")
        if kind != "harness" and command is not None:
            raise ValueError(f"agent.command is only for agent.kind harness, not {kind!r}")
        return command


class BackendSpec(Model):
    """One LLM backend: a vLLM OpenAI-compatible server."""

    url: str = Field(pattern=r"^https?://", description="the server's base URL (http or https)")
    name: str | None = Field(default=None, description="a name for logs and metrics (default: the URL)")


class LLMSpec(Model):
    """The model: its tokenizer and the backends that serve it (token-in/token-out)."""

    tokenizer: str | None = Field(default=None, description="Hugging Face tokenizer directory (the model's own chat "
                                  "template); required unless agent.kind makes no LLM call (oracle)")
    model: str | None = Field(default=None, description="model name sent to the backends (default: discovered)")
    backends: list[BackendSpec] = Field(default_factory=list, description="the servers; may change while the "
                                        "job runs (rolloutctl backends add|remove)")
    max_episodes_per_backend: int | None = Field(
        default=None, ge=1, le=1_000_000, description="this job's episodes in RUN at once per backend, each from its "
        "lease until its RUN ends (default: no cap of its own); it limits this job only: the backend's own cap is the "
        "controller's, else the max_num_seqs vLLM reports, else 256, shared among its jobs by priority")
