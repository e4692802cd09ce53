"""The scripted upstream itself: its answers parse as vLLM 0.32's own pydantic models and
dump back to the same JSON (where vLLM is installed), and the script decides as documented."""

from __future__ import annotations

import importlib.util

import pytest

from overnight.testing import scripted, scripted_apis

pytestmark = pytest.mark.compat
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
RESPONSES = {"model": "m", "input": "hi", "tools": [{"type": "function", **TOOLS[0]["function"]}]}
SCHEMA = {
    "type": "object",
    "properties": {
        "r": {"$ref": "#/$defs/R"},
        "n": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
    },
    "$defs": {
        "R": {
            "type": "object",
            "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}}},
        }
    },
}
vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def test_instance_fits_the_schema():
    assert scripted.instance(SCHEMA, SCHEMA) == {"r": {"tags": ["a"]}, "n": 3}


def test_tool_call_then_answer():
    first = scripted.plan(scripted.chat_conversation(CHAT))
    assert [c.name for c in first.calls] == ["get_weather"] and first.text is None
    call = {
        "id": first.calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": "{}"},
    }
    messages = [*CHAT["messages"], {"role": "assistant", "tool_calls": [call]}]
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": "sunny"})
    assert scripted.plan(scripted.chat_conversation({**CHAT, "messages": messages})).text


@vllm
@pytest.mark.parametrize(
    "extra", [{}, {"return_token_ids": True, "logprobs": True, "top_logprobs": 2}]
)
def test_chat_shapes_are_vllms(extra):
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionResponse,
        ChatCompletionStreamResponse,
    )

    whole = scripted.chat_whole({**CHAT, **extra})
    assert ChatCompletionResponse.model_validate(whole).model_dump(mode="json") == whole
    for chunk in scripted.chat_chunks({**CHAT, **extra, "stream_options": {"include_usage": True}}):
        parsed = ChatCompletionStreamResponse.model_validate(chunk)
        assert parsed.model_dump(mode="json", exclude_unset=True) == chunk


@vllm
@pytest.mark.parametrize(
    "body", [RESPONSES, {"model": "m", "input": "hi", "include": [scripted_apis.LOGPROBS_INCLUDE]}]
)
def test_responses_shapes_are_vllms(body):
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

    # vLLM builds its events from the openai package's types; its response object is its own.
    adapter = TypeAdapter(ResponseStreamEvent)
    events = scripted_apis.responses_events(body, scripted_apis.responses_conversation(body, []))
    for event in events[2:-1]:
        assert adapter.validate_python(event).model_dump(mode="json", by_alias=True) == event
    for event in events[:2] + events[-1:]:
        parsed = ResponsesResponse.model_validate(event["response"])
        assert parsed.model_dump(mode="json", by_alias=True) == event["response"]


@vllm
def test_messages_shapes_are_vllms():
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesResponse, AnthropicStreamEvent

    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}
    body["tools"] = [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]
    whole = scripted_apis.message_whole(body)
    assert AnthropicMessagesResponse.model_validate(whole).model_dump(exclude_none=True) == whole
    for _, data in scripted_apis.message_events(body):
        assert AnthropicStreamEvent.model_validate(data).model_dump(exclude_unset=True) == data
