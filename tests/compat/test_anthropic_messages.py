"""The Anthropic SDK against vLLM's Messages API (`/v1/messages`): a streamed tool_use,
the tool's result, a final answer. Agents written for Claude call it this way."""

from __future__ import annotations

import pytest

from .conftest import MODEL, assert_same_bytes, need
from .helpers import GROUP, TASK, check_rows, get_weather

pytestmark = pytest.mark.compat
ROLLOUT = "anthropic-1"
TOOL = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def agent(origin: str, proxied: bool):
    need("anthropic")
    import anthropic

    headers = {"X-Rollout-Group": GROUP, "X-Rollout-Id": ROLLOUT} if proxied else {}
    client = anthropic.Anthropic(base_url=origin, api_key="unused", default_headers=headers)
    messages = [{"role": "user", "content": TASK}]
    with client.messages.stream(model=MODEL, max_tokens=200, messages=messages, tools=[TOOL]) as s:
        first = s.get_final_message()
    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    results = [
        {"type": "tool_result", "tool_use_id": b.id, "content": get_weather(**b.input)}
        for b in first.content
        if b.type == "tool_use"
    ]
    messages.append({"role": "user", "content": results})
    final = client.messages.create(model=MODEL, max_tokens=200, messages=messages, tools=[TOOL])
    return first.stop_reason, final.content[0].text


@pytest.fixture(scope="module")
def runs(stack):
    return stack.run_both(agent)


def test_runs_to_the_end(runs):
    assert runs.direct_result == runs.proxied_result == ("tool_use", "Done after 1 tool result.")


def test_same_bytes(runs):
    assert_same_bytes(runs)


def test_rows(runs, stack):
    check_rows(stack.rows(ROLLOUT, expect=2), ROLLOUT, turns=2, exact=False, extends=True)
