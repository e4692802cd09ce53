"""Issue 12: every API agents use is captured, streams pass as vLLM sends them, ids are
free text, nothing passes uncaptured in silence. One test (at least) per numbered item
of the issue; each fails on the proxy before the issue (commit f2c8522)."""

from __future__ import annotations

import json
import logging
from urllib.parse import quote

import aiohttp
import pytest
from aiohttp import web

from overnight.proxy.capture.conversation import (
    ResponseChains,
    carried_over,
    resolve_responses_request,
)
from overnight.trainer.choose.inputs import Selection

from .helpers import rows, wait_for_rows

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": TOOLS[0]["parameters"]}


@pytest.fixture
def scripted(fake_settings):
    fake_settings["scripted"] = True  # chat completions answer as the scripted agent


async def both(proxy, fake, path: str, body: dict, **kw) -> tuple[str, str]:
    """The answer's text through the proxy, then directly from the upstream."""
    through = await (await proxy.post(path, json=body, **kw)).text()
    async with aiohttp.ClientSession() as s, s.post(fake.make_url(path), json=body) as r:
        return through, await r.text()


def sse_events(text: str) -> list[dict | str]:
    """The `data:` payloads of a stream, named events (`event: ...`) included."""
    out: list[dict | str] = []
    for block in text.split("\n\n"):
        for line in block.split("\n"):
            if line.startswith("data: "):
                data = line[6:]
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def conversation(row: dict) -> list[dict]:
    return json.loads(row["request"])["messages"]


def reply(row: dict) -> dict:
    return json.loads(row["response"])["choices"][0]["message"]


# -- item 1: the Responses API ----------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_responses_are_recorded_with_the_chain_vllm_prompts(
    make_proxy, fake, tmp_path, stream
):
    proxy = await make_proxy()
    headers = {"X-Rollout-Group": "g", "X-Rollout-Id": "r"}
    first = {
        "model": "m",
        "input": "Weather in Paris?",
        "tools": TOOLS,
        "instructions": "Be brief.",
    }
    through, direct = await both(
        proxy, fake, "/v1/responses", {**first, "stream": stream}, headers=headers
    )
    assert through == direct  # passed through untouched
    final = sse_events(through)[-1]["response"] if stream else json.loads(through)
    (call,) = final["output"]
    assert call["type"] == "function_call"
    # The next turn names only the new items: the record must still hold all of them.
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C"}
    second = {"model": "m", "input": [result], "tools": TOOLS, "previous_response_id": final["id"]}
    r = await proxy.post("/v1/responses", json={**second, "stream": stream}, headers=headers)
    assert r.status == 200
    await r.read()
    turn1, turn2 = await wait_for_rows(tmp_path / "data", 2)
    assert (turn1["endpoint"], turn1["rollout_id"], turn1["turn_index"]) == ("responses", "r", 0)
    assert turn1["finish_reason"] == "tool_calls" and not turn1["partial"]
    assert conversation(turn1) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    (tool_call,) = reply(turn1)["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather" and tool_call["id"] == call["call_id"]
    assert json.loads(turn1["request"])["tools"][0]["function"]["name"] == "get_weather"
    assert json.loads(turn1["response"])["raw"]["id"] == final["id"]  # the API's own answer
    # What vLLM 0.32 prompts a continuation with (conversation.py): the earlier messages
    # without their system message (instructions do not carry over), of the earlier reply
    # only its text (this one has none: its function call is dropped), then the new items.
    assert conversation(turn2) == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "tool", "tool_call_id": call["call_id"], "content": "21 C"},
    ]
    assert (
        reply(turn2)["content"] == "Done after 1 tool result." and turn2["finish_reason"] == "stop"
    )
    assert turn2["prompt_tokens"] and turn2["completion_tokens"]
    # The fake gives no token ids (vLLM does: test_responses_exact.py).
    assert turn2["prompt_token_ids"] is None


def test_a_continuation_carries_over_what_vllm_does():
    """vLLM 0.32 drops the earlier system message, function calls and reasoning."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "tool_calls": [call], "reasoning": "r"},
    ]
    assert carried_over(conversation) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]


async def test_a_chain_begun_before_a_restart_is_rebuilt_from_the_store(make_proxy, tmp_path):
    """The proxy that answered the first response is gone: the next process on the same
    data directory has none of it in memory, and finds its record in the store; an id
    found nowhere is recorded from the new items, the record naming it."""
    data = tmp_path / "data"
    before = await make_proxy()
    first = {"model": "m", "input": "Say hello.", "instructions": "Be brief."}
    answer = await (await before.post("/v1/responses", json=first)).json()
    await wait_for_rows(data, 1)
    await before.close()
    chains = ResponseChains(data_dir=data)  # a new process: nothing in memory
    second = {"model": "m", "input": "Again.", "previous_response_id": answer["id"]}
    out = await resolve_responses_request(second, chains)
    text = answer["output"][0]["content"][0]["text"]
    assert out["messages"] == [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Again."},
    ]
    assert "history_missing" not in out and chains.get(answer["id"]) is not None
    gone = await resolve_responses_request({**second, "previous_response_id": "resp_x"}, chains)
    assert gone["history_missing"] == "resp_x"
    assert gone["messages"] == [{"role": "user", "content": "Again."}]


async def test_a_chain_begun_before_a_restart_is_recorded_whole(make_proxy, tmp_path):
    """A new proxy on the same data directory (a restart) has the first response of a
    chain only in the store: the next turn's record still holds the whole conversation.
    A chain found nowhere is recorded with a note; the client gets vLLM's own answer."""
    data = tmp_path / "data"
    headers = {"X-Rollout-Group": "g", "X-Rollout-Id": "r"}
    before = await make_proxy()
    first = {"model": "m", "input": "Say hello.", "instructions": "Be brief."}
    answer = await (await before.post("/v1/responses", json=first, headers=headers)).json()
    await wait_for_rows(data, 1)
    await before.close()
    after = await make_proxy()  # a new app on the same data directory
    second = {"model": "m", "input": "Again.", "previous_response_id": answer["id"]}
    r = await after.post("/v1/responses", json=second, headers=headers)
    assert r.status == 200, await r.text()
    _, turn2 = await wait_for_rows(data, 2)
    assert conversation(turn2) == [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": answer["output"][0]["content"][0]["text"]},
        {"role": "user", "content": "Again."},
    ]
    assert "history_missing" not in json.loads(turn2["request"])
    gone = {**second, "previous_response_id": "resp_gone"}
    r = await after.post("/v1/responses", json=gone, headers=headers)
    assert r.status == 404  # vLLM's answer (here the fake's), not a failure of ours
    *_, turn3 = await wait_for_rows(data, 3)
    assert json.loads(turn3["request"])["history_missing"] == "resp_gone"
    assert conversation(turn3) == [{"role": "user", "content": "Again."}]


async def test_responses_logprobs_asked_by_the_client_are_recorded(make_proxy, tmp_path):
    proxy = await make_proxy()
    body = {"model": "m", "input": "hi", "include": ["message.output_text.logprobs"]}
    r = await proxy.post("/v1/responses", json={**body, "stream": True})
    events = sse_events(await r.text())
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    expected = [d["logprobs"][0]["logprob"] for d in deltas]
    assert expected and row["completion_logprobs"] == pytest.approx(expected)


async def test_a_responses_stream_cut_short_is_recorded_as_partial(make_proxy, tmp_path):
    async def broken(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        item = {"type": "message", "id": "m1", "role": "assistant", "content": []}
        for event in (
            {"type": "response.output_item.added", "output_index": 0, "item": item},
            {"type": "response.output_text.delta", "output_index": 0, "delta": "Hel"},
        ):
            await response.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/responses", broken)
    from aiohttp.test_utils import TestServer

    server = TestServer(app)
    await server.start_server()
    try:
        proxy = await make_proxy(upstream=str(server.make_url("")))
        r = await proxy.post("/v1/responses", json={"model": "m", "input": "hi", "stream": True})
        assert "upstream_disconnected" in await r.text()
        (row,) = await wait_for_rows(tmp_path / "data", 1)
        assert row["partial"] and "without its last event" in row["error"]
        assert reply(row)["content"] == "Hel"
    finally:
        await server.close()


# -- item 5 of the issue: the Anthropic Messages API ------------------------------------
@pytest.mark.parametrize("stream", [False, True])
async def test_messages_are_recorded_in_the_chat_shape(make_proxy, fake, tmp_path, stream):
    proxy = await make_proxy()
    first = {
        "model": "m",
        "max_tokens": 50,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [ANTHROPIC_TOOL],
    }
    through, direct = await both(
        proxy, fake, "/v1/messages", {**first, "stream": stream}, headers={"X-Rollout-Id": "a"}
    )
    assert through == direct
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert (row["endpoint"], row["rollout_id"], row["finish_reason"]) == (
        "messages",
        "a",
        "tool_calls",
    )
    assert conversation(row) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    (call,) = reply(row)["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])
    raw = json.loads(row["response"])["raw"]
    assert raw["stop_reason"] == "tool_use" and raw["content"][0]["type"] == "tool_use"
    assert json.loads(row["request"])["raw"]["system"] == "Be brief."
    assert row["completion_tokens"] and row["prompt_token_ids"] is None


def test_tool_results_in_messages_become_tool_messages():
    from overnight.proxy.capture.conversation import anthropic_messages

    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "ok"}],
    }
    assert anthropic_messages(
        [{"type": "text", "text": "sys"}],
        [
            {"role": "assistant", "content": [{"type": "text", "text": "calling"}, use]},
            {"role": "user", "content": [result, {"type": "text", "text": "go on"}]},
        ],
    ) == [
        {"role": "system", "content": "sys"},
        {
            "role": "assistant",
            "content": "calling",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "ok"},
        {"role": "user", "content": "go on"},
    ]


# -- item 2: streams as vLLM would send them --------------------------------------------
async def test_chunks_only_our_additions_caused_are_dropped(make_proxy, fake, scripted, tmp_path):
    proxy = await make_proxy()
    body = {**CHAT, "tools": CHAT_TOOLS, "tool_choice": "required", "stream": True}
    through, direct = await both(proxy, fake, "/v1/chat/completions", body)
    assert through == direct
    choices = [c for e in sse_events(through) if isinstance(e, dict) for c in e["choices"]]
    assert not [c for c in choices if c["delta"] == {} and c["finish_reason"] is None]
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    # The record took every token, the held-back tool-call markup included.
    assert len(row["completion_token_ids"]) == len(row["completion_logprobs"])
    assert len(row["completion_token_ids"]) > len(sse_events(through)) - 2


async def test_a_client_that_asked_for_logprobs_keeps_every_chunk(make_proxy, fake, scripted):
    proxy = await make_proxy()
    body = {
        **CHAT,
        "tools": CHAT_TOOLS,
        "tool_choice": "required",
        "stream": True,
        "logprobs": True,
    }
    through, direct = await both(proxy, fake, "/v1/chat/completions", body)
    assert through == direct and '"delta":{}' in through


# -- item 3: continuous usage without include_usage --------------------------------------
async def test_continuous_usage_without_include_usage_gives_no_usage(make_proxy, fake, scripted):
    proxy = await make_proxy()
    body = {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    through, direct = await both(proxy, fake, "/v1/chat/completions", body)
    assert through == direct and '"usage"' not in through


# -- item 4: header values in UTF-8 (or not) are forwarded as the client sent them: already
# so at f2c8522, tested by tests/test_hostile.py::test_header_values_outside_latin_1_...


# -- item 6: ids are free text -----------------------------------------------------------
NATURAL = "task 17/attempt 3"


async def test_natural_ids_in_headers_metadata_and_url(make_proxy, tmp_path):
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Id": NATURAL})
    assert r.status == 200
    body = {**CHAT, "metadata": {"rollout_group": "τ group", "rollout_id": NATURAL + " m"}}
    assert (await proxy.post("/v1/chat/completions", json=body)).status == 200
    prefix = f"/rollouts/{quote('g/1', safe='')}/{quote(NATURAL, safe='')}/v1/chat/completions"
    assert (await proxy.post(prefix, json=CHAT)).status == 200
    found = await wait_for_rows(tmp_path / "data", 3)
    assert [(f["group_id"], f["rollout_id"]) for f in found] == [
        (NATURAL, NATURAL),
        ("τ group", NATURAL + " m"),
        ("g/1", NATURAL),
    ]
    reward = f"/v1/rollouts/{quote(NATURAL, safe='')}/reward"
    assert (await proxy.post(reward, json={"reward": 1.0})).status == 200
    assert rows(tmp_path / "data", "SELECT rollout_id FROM rewards") == [{"rollout_id": NATURAL}]
    # Links to it are escaped, and lead back to it.
    page = await (await proxy.get(f"/ui/groups/{quote('g/1', safe='')}")).text()
    assert f'href="/ui/rollouts/{quote(NATURAL, safe="")}"' in page
    assert (await proxy.get(f"/ui/rollouts/{quote(NATURAL, safe='')}")).status == 200


# -- nothing passes uncaptured in silence -----------------------------------------------
async def test_uncaptured_model_output_is_counted_warned_and_shown(
    make_proxy, aiohttp_server, caplog
):
    async def transcribe(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"text": "hello"})

    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", transcribe)
    upstream = await aiohttp_server(app)
    proxy = await make_proxy(upstream=str(upstream.make_url("")))
    with caplog.at_level(logging.WARNING, logger="overnight.proxy"):
        for _ in range(2):
            r = await proxy.post("/v1/audio/transcriptions", data=b"audio")
            assert r.status == 200
    warned = [m for m in caplog.messages if "audio/transcriptions" in m]
    assert len(warned) == 1  # once per path
    stats = await (await proxy.get("/admin/stats")).json()
    assert stats["uncaptured"] == {"audio/transcriptions": 2}
    page = await (await proxy.get("/ui")).text()
    assert "/v1/audio/transcriptions</code> (2)" in page


# -- what the trainer makes of them ------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"model": "m", "input": "Say hello."}),
        (
            "/v1/messages",
            {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]},
        ),
    ],
)
async def test_responses_and_messages_rows_are_trained_from_their_text(
    make_proxy, tmp_path, tiny_model_dir, path, body
):
    """A row without token ids (every Messages row; a Responses row vLLM gave no ids or no
    logprob per token, as the fake never does): the trainer re-tokenises the chat-shaped
    conversation the proxy recorded (not token-exact, said in the plan)."""
    from transformers import AutoTokenizer

    from overnight.config import TrainConfig
    from overnight.trainer.choose.plan import plan_run

    proxy = await make_proxy()
    json_type = {"Content-Type": "application/json"}
    for i, reward in enumerate([0.0, 1.0]):
        headers = {"X-Rollout-Group": "g", "X-Rollout-Id": f"r{i}"}
        r = await proxy.post(path, json=body, headers=headers)
        assert r.status == 200, await r.text()
        r = await proxy.post(f"/v1/rollouts/r{i}/reward", json={"reward": reward})
        assert r.status == 200, await r.text()
        r = await proxy.post(f"/v1/rollouts/r{i}/finish", headers=json_type)
        assert r.status == 200, await r.text()
    await wait_for_rows(tmp_path / "data", 2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    plan = plan_run(Selection(tmp_path / "data", 600, tokenizer=tokenizer), TrainConfig())
    assert plan.groups == ["g"] and plan.retokenised == 2, plan.lines()
    assert all(not s.exact and s.trained_tokens > 0 for s in plan.samples)


@pytest.mark.vllm
async def test_retokenisation_mismatch_on_real_vllm(vllm_server, tmp_path, tiny_model_dir):
    """bench/retokenize_mismatch.py on a small sample (5 conversations per API): what the
    trainer rebuilds from a Responses or Messages record, against what vLLM used."""
    import importlib.util
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    path = Path(__file__).resolve().parent.parent / "bench" / "retokenize_mismatch.py"
    spec = importlib.util.spec_from_file_location("retokenize_mismatch", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tallies = await bench.measure(vllm_server.url, tmp_path / "data", tokenizer, rounds=1)
    print(bench.report(tallies))
    for api, tally in tallies.items():
        assert tally.records == 5 and tally.not_trained == 0, api
        # The prompt: the chat-shaped record renders to exactly vLLM's prompt, on every API.
        assert tally.rate("prompt count") == 0, api
        if api != "messages":  # ids to compare with (Messages gives counts only)
            assert tally.rate("prompt ids") == 0 and tally.rate("reply text") == 0, api
    # The reply: re-encoding the text gives other ids than were sampled, always on the
    # tiny model's vocabulary (multi-digit tokens its loaded tokenizer never produces),
    # and, sampling only tokens the tokenizer reproduces, at most 4 of 5 (measured 3).
    assert tallies["chat.completions"].rate("reply ids") == 1
    assert tallies[bench.CANONICAL].rate("reply ids") <= 0.8
    # Asked for them, vLLM's Responses API gives its own ids and one logprob per reply
    # token, and the proxy records the turn token-exact from them.
    assert tallies["responses"].rate("logprobs per token") == 0
    assert tallies["responses"].rate("recorded exact") == 0
