"""The harness gateway serves in the rollout's trace: a black-box harness's calls (a real bwrap sandbox, the real
tiny vLLM engine) become `gateway` spans under the RUN span that started the gateway, their model calls under them,
though uvicorn serves each call in a task of its own."""
import asyncio
import shutil
from pathlib import Path

import pytest

from rolloutd.agents.daemon.llmgate import TrackedLLM
from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext
from rolloutd.agents.tasks import get_handler
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.crds.kit import trace_spans, tracing

from support.harbor_rollouts import task_sandbox

TASKS = Path(__file__).resolve().parents[2] / "examples" / "harbor" / "tasks"
# a black-box harness that only knows OPENAI_BASE_URL: the model list, then two chat calls
HARNESS = r'''
import json, os, urllib.request
base = os.environ["OPENAI_BASE_URL"]
urllib.request.urlopen(base + "/models").read()
msgs = [{"role": "user", "content": "Count the words."}]
for _ in range(2):
    req = urllib.request.Request(base + "/chat/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": "any", "messages": msgs, "max_tokens": 8}).encode())
    msgs += [json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["message"],
             {"role": "user", "content": "Go on."}]
'''


def test_harness_calls_are_spans_under_the_rollouts_run_span(tiny_engine):
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    handler = get_handler("harbor")
    task = {t["id"]: t for t in handler.load(TASKS)}["word-count"]

    async def go():
        async with task_sandbox(handler, task) as sandbox, VLLMBackend(tiny_engine.url) as llm:
            await sandbox.write_file("/tmp/harness.py", HARNESS)
            config = AgentConfig(agent_kind="harness", agent_command="python3 /tmp/harness.py",
                                 sampling=SamplingParams(max_tokens=8))
            with trace_spans.span("RUN"):
                return await handler.run(task, sandbox, TrackedLLM(llm), tokenizer=ChatTokenizer(model_dir("tiny")),
                                         config=config, ctx=RolloutContext(job="gw", prompt=0, sample=0))

    tracing.use(provider)
    try:
        trajectory = asyncio.run(go())
    finally:
        tracing.use(None)
    assert trajectory.failure.kind.value != "infra", trajectory.failure.reason
    spans = exporter.get_finished_spans()
    (run,) = [s for s in spans if s.name == "RUN"]
    gateway = [s for s in spans if s.name.startswith("gateway ")]
    assert {s.name for s in gateway} >= {"gateway POST /v1/chat/completions", "gateway GET /v1/models"}
    assert all(s.parent.span_id == run.context.span_id and s.context.trace_id == run.context.trace_id
               for s in gateway)
    calls = [s for s in spans if s.name.startswith("text_completion")]
    assert len(calls) == 2   # the harness's two chat calls
    ids = {s.context.span_id for s in gateway}
    assert all(s.parent.span_id in ids for s in calls)
    assert sum(s.attributes["gen_ai.usage.output_tokens"] for s in calls) == sum(
        sum(seg.loss_mask) for seg in trajectory.segments or [trajectory])   # the recorded calls' generated ids
