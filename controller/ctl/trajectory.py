"""`rolloutctl trajectory NAME SEQ`: one trajectory, decoded as the web UI's trajectory page shows it.

Registered on rolloutctl's app by `app.py` (`register`); reads the job (its tokenizer, `spec.llm.tokenizer`) and
the trajectory through the trainer client, decodes it with `decode.py` and prints it with rich. The text is
the model's: it is printed as `rich.text.Text`, never parsed as rich markup. Next step: the GRPO group beside it.
"""
from __future__ import annotations

import json
from typing import Any, Callable

import typer
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..decode import decode

_ROLE_STYLE = {"user": "green", "assistant": "blue", "tool": "yellow", "system": "magenta"}


def render(view: dict[str, Any], seq: int) -> Group:
    """The decoded trajectory (`decode.decode`'s view) as rich renderables."""
    fail = view.get("failure") or {}
    head = Table.grid(padding=(0, 2))
    for label, value in (("trajectory", seq), ("reward", view.get("reward")), ("failure", fail.get("kind", "none")),
                         ("reason", fail.get("reason") or ""), ("task", view.get("taskId")),
                         ("prompt / sample", f"{view.get('prompt')} / {view.get('sample')}"),
                         ("policy version", view.get("policyVersion")), ("finish", view.get("finishReason"))):
        if value not in (None, ""):
            head.add_row(Text(label, style="bold"), Text(str(value)))
    parts: list[Any] = [head]
    for m in view["messages"]:
        body = Text(m["content"])
        if m["toolCalls"]:
            body.append("\n" + json.dumps(m["toolCalls"], indent=1), style="dim")
        parts.append(Panel(body, title=Text(m["role"]), title_align="left", border_style=_ROLE_STYLE.get(m["role"], "white")))
    for i, s in enumerate(view["sequences"]):
        if not view["messages"] or len(view["sequences"]) > 1:  # the conversation shown above says the same
            parts.append(Panel(Text(s["prompt"]), title=Text(f"prompt (segment {i + 1})"), title_align="left"))
            for t in s["turns"]:
                body = Text(t["assistant"])
                if t["toolCalls"]:
                    body.append("\n" + json.dumps(t["toolCalls"], indent=1), style="dim")
                if t["observation"]:
                    body.append("\n" + t["observation"], style="yellow")
                parts.append(Panel(body, title=Text(f"assistant, turn {t['turn'] + 1}"), title_align="left"))
        tv = s["tokenView"]
        trained = sum(1 for k in tv["tokens"] if k["mask"] == 1)
        parts.append(Text(f"tokens: {tv['length']} ({trained} trained on, loss mask 1)", style="dim"))
    if view.get("tokenizerProblem"):
        parts.append(Text("no token text: " + view["tokenizerProblem"], style="dim"))
    parts.append(Panel(Text(json.dumps(view.get("rewardDetails") or {}, indent=1)), title="reward details",
                       title_align="left"))
    return Group(*parts)


def register(app: typer.Typer, client: Callable[[], Any], run: Callable[[Callable[[], Any]], Any]) -> None:
    """Add the `trajectory` command to rolloutctl's `app` (`client` and `run` are app.py's)."""

    @app.command()
    def trajectory(name: str = typer.Argument(..., help="the RolloutJob"),
                   seq: int = typer.Argument(..., min=1, help="the trajectory's seq (rolloutctl trajectories)"),
                   output: str = typer.Option("text", "-o", "--output", help="text|json")) -> None:
        """Print one trajectory decoded with the job's tokenizer: prompt, turns, tool calls, reward."""
        c = client()

        def go() -> None:
            job = c.get(name)
            found = next(iter(c.trajectories(name, cursor=seq - 1, page=1)), None)
            if found is None or found.get("seq") != seq:
                raise typer.BadParameter(f"rolloutjob {name} has no trajectory {seq}", param_hint="SEQ")
            if output == "json":
                print(json.dumps(found, indent=2))
                return
            view = decode(found, (job.get("spec", {}).get("llm") or {}).get("tokenizer"))
            Console(highlight=False, soft_wrap=False).print(render(view, seq))
        run(go)
