"""The tool-call parser: Hermes `<tool_call>` JSON, the fenced-code fallback, malformed calls."""
from rolloutd.agents.loop.tools import parse_tool_calls, tool_instructions, tool_specs

ALL = ["bash", "ipython", "editor", "submit"]


def test_hermes_single_call():
    text = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
    [call] = parse_tool_calls(text, ALL)
    assert (call.name, call.arguments, call.error, call.format) == ("bash", {"command": "ls -la"}, None, "hermes")


def test_hermes_several_calls_in_order_and_string_arguments():
    text = ('<tool_call>{"name": "editor", "arguments": {"command": "view", "path": "a.py"}}</tool_call>'
            '<tool_call>{"name": "submit", "arguments": "{\\"answer\\": \\"42\\"}"}</tool_call>')
    calls = parse_tool_calls(text, ALL)
    assert [c.name for c in calls] == ["editor", "submit"]
    assert calls[1].arguments == {"answer": "42"}
    assert all(c.error is None for c in calls)


def test_unclosed_last_call_is_accepted_when_its_json_is_complete():
    [call] = parse_tool_calls('<tool_call>{"name": "submit", "arguments": {"answer": "7"}}', ALL)
    assert call.error is None and call.arguments == {"answer": "7"}


def test_malformed_calls_become_errors_not_exceptions():
    bad_json = parse_tool_calls('<tool_call>{"name": "bash", "arguments": {"command": </tool_call>', ALL)
    unknown = parse_tool_calls('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', ALL)
    missing = parse_tool_calls('<tool_call>{"name": "bash", "arguments": {}}</tool_call>', ALL)
    not_allowed = parse_tool_calls('<tool_call>{"name": "ipython", "arguments": {"code": "1"}}</tool_call>', ["bash"])
    for calls, needle in ((bad_json, "not valid JSON"), (unknown, "unknown tool"),
                          (missing, "needs command"), (not_allowed, "unknown tool")):
        [call] = calls
        assert call.error and needle in call.error


def test_fenced_fallback_bash_and_python():
    text = "First:\n```bash\necho hi\nls\n```\nthen\n```python\nprint(1+1)\n```\n```text\nnot code\n```"
    calls = parse_tool_calls(text, ALL)
    assert [(c.name, c.arguments, c.format) for c in calls] == [
        ("bash", {"command": "echo hi\nls"}, "fenced"),
        ("ipython", {"code": "print(1+1)"}, "fenced"),
    ]


def test_fenced_fallback_only_without_tool_call_and_only_for_allowed_tools():
    text = '```bash\necho x\n```\n<tool_call>{"name": "submit", "arguments": {"answer": "1"}}</tool_call>'
    assert [c.name for c in parse_tool_calls(text, ALL)] == ["submit"]
    assert parse_tool_calls("```python\nprint(1)\n```", ["bash", "submit"]) == []


def test_plain_answer_has_no_calls():
    assert parse_tool_calls("The answer is 42.", ALL) == []


def test_specs_and_instructions_name_every_tool():
    names = [s["function"]["name"] for s in tool_specs(ALL)]
    assert names == ALL
    text = tool_instructions(ALL)
    assert all(n in text for n in ALL) and "<tool_call>" in text
