"""The UI tests' cluster: jobs applied through the API and their trajectories reported through the real node
protocol (register, lease, results, as the admin may), made token-exact with the tiny model's tokenizer."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.controller.access.auth import create_scoped_token
from rolloutd.crds.node import NODE_PROTOCOL

P = "/apis/rolloutd.io/v1alpha1"
TINY = model_dir("tiny")
HOSTILE = ('<script>alert("xss")</script></textarea><img src=x onerror=alert(2)> '
           '<a href="javascript:alert(3)">click</a> [me](javascript:alert(4))')


class Cluster:
    def __init__(self, controller, base: Path):
        self.controller, self.base = controller, base
        self.admin = httpx.Client(base_url=controller.url, timeout=30,
                                  headers={"Authorization": f"Bearer {controller.token}"})
        # the admin token acts as any node (a job's node credential registers only the daemons its executor starts)
        self.node_api = httpx.Client(base_url=controller.url, timeout=30,
                                     headers={"Authorization": f"Bearer {controller.token}"})
        self.tok = AutoTokenizer.from_pretrained(str(TINY), local_files_only=True)
        self.scoped = create_scoped_token(controller.data_dir / "tokens", "team-a-reader", read_only=True,
                                          namespaces=["team-a"]).token
        self.nodes: dict[str, str] = {}
        self.leases: dict[str, list[dict[str, Any]]] = {}

    # ------------------------------------------------------------ jobs

    def create_job(self, namespace: str, name: str, prompts: int, samples: int = 2, pipeline: dict | None = None) -> None:
        data = self.base / f"{namespace}-{name}.jsonl"
        data.write_text("".join(json.dumps({"id": f"{name}-q{i}", "question": f"What is {i}+3?", "answer": str(i + 3)})
                                + "\n" for i in range(prompts)))
        doc = {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name, "namespace": namespace},
               "spec": {"tasks": {"kind": "math", "source": str(data)}, "samplesPerPrompt": samples,
                        "llm": {"tokenizer": str(TINY)},
                        "executor": {"kind": "local", "nodes": 0}, **({"pipeline": pipeline} if pipeline else {})}}
        r = self.admin.post(f"{P}/namespaces/{namespace}/rolloutjobs", json=doc)
        assert r.status_code == 201, r.text
        self.wait(lambda: self.job(namespace, name)["status"].get("counts", {}).get("total") == prompts * samples,
                  f"{namespace}/{name} expanded")
        r = self.node_api.post(f"{P}/namespaces/{namespace}/rolloutjobs/{name}/nodes/register",
                               json={"job": f"{namespace}/{name}", "name": f"node-{name}", "host": "test-host",
                                     "protocol": NODE_PROTOCOL})
        assert r.status_code == 200, r.text
        self.nodes[f"{namespace}/{name}"] = r.json()["nodeId"]
        self.leases[f"{namespace}/{name}"] = []
        assert self.lease(f"{namespace}/{name}", prompts * samples) == prompts * samples

    def lease(self, key: str, n: int) -> int:
        """Lease up to `n` more rollouts of job `key` (queued ones: first attempts, or retries); how many came."""
        r = self.node_api.post(f"{P}/nodes/{self.nodes[key]}/lease", json={"maxItems": n})
        assert r.status_code == 200, r.text
        self.leases[key] += r.json()["leases"]
        return len(r.json()["leases"])

    def job(self, namespace: str, name: str) -> dict[str, Any]:
        r = self.admin.get(f"{P}/namespaces/{namespace}/rolloutjobs/{name}")
        r.raise_for_status()
        return r.json()

    @staticmethod
    def wait(predicate, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    # ------------------------------------------------------------ trajectories

    def trajectory(self, key: str, lease: dict[str, Any], answer: str, reward: float | None, *,
                   text: str | None = None, failure: dict[str, str] | None = None) -> dict[str, Any]:
        """A one-turn rollout: the chat-templated prompt, the assistant's reply (`text`), the tool's observation."""
        question = lease["task"].get("question", "")
        chat = self.tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=False)
        prompt = self.tok.encode(chat, add_special_tokens=False)
        reply = text or f"The answer is {answer}."
        gen = self.tok.encode(reply, add_special_tokens=False)
        obs = self.tok.encode(f"\nobservation: submitted {answer}\n", add_special_tokens=False)
        ids = [*prompt, *gen, *obs]
        p, g = len(prompt), len(gen)
        return {"job": key, "prompt": lease["prompt"], "sample": lease["sample"], "taskId": lease["task"].get("id"),
                "tokenIds": ids, "promptLength": p, "lossMask": [0] * p + [1] * g + [0] * len(obs),
                "logprobs": [None] * p + [-0.05 * (k % 7) for k in range(g)] + [None] * len(obs),
                "turns": [{"generatedStart": p, "generatedEnd": p + g, "observationStart": p + g,
                           "observationEnd": len(ids), "finishReason": "stop",
                           "toolCalls": [{"name": "submit", "arguments": {"answer": answer}}]}],
                "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply},
                             {"role": "tool", "content": f"submitted {answer}"}],
                "reward": reward, "rewardDetails": {"answer": answer, "verifier": f"expected {answer}"},
                "failure": failure or {"kind": "none", "reason": ""}, "finishReason": "stop", "policyVersion": 0,
                "timings": {"queue": 0.01, "init": 0.1, "run": 0.5 + lease["sample"], "eval": 0.05}}

    def report(self, key: str, n: int, **kw) -> list[dict[str, Any]]:
        """Report the next `n` leased rollouts of job `key` (reward 1 for sample 0, else 0); their trajectories."""
        leases, sent = self.leases[key][:n], []
        self.leases[key] = self.leases[key][n:]
        for lease in leases:
            answer = str(lease["task"].get("answer", ""))
            t = self.trajectory(key, lease, answer, kw.get("reward", 1.0 if lease["sample"] == 0 else 0.0),
                                text=kw.get("text"), failure=kw.get("failure"))
            r = self.node_api.post(f"{P}/nodes/{self.nodes[key]}/results",
                                   json={"results": [{"attemptId": lease["attemptId"], "trajectory": t}]})
            assert r.status_code == 200 and lease["attemptId"] in r.json()["accepted"], r.text
            sent.append(t)
        return sent

    def seqs(self, namespace: str, name: str) -> list[dict[str, Any]]:
        r = self.admin.get(f"{P}/namespaces/{namespace}/rolloutjobs/{name}/trajectories")
        r.raise_for_status()
        return [json.loads(line) for line in r.text.splitlines() if line.strip()]
