"""The proxy in-process against the in-process fake vLLM: forwarding and capture."""

from __future__ import annotations

import json

import pytest

from overnight.testing.fake_upstream import FINGERPRINT

from .helpers import sse_events, wait_for_rows, without_ids

CHAT = {
    "model": "policy",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "max_tokens": 3,
}


async def direct(fake_client, path: str, body: dict) -> dict | str:
    """What the fake answers when asked directly, exactly as the client asked."""
    r = await fake_client.post(path, json=body)
    return await r.json() if not body.get("stream") else await r.text()


@pytest.fixture
async def fake_client(aiohttp_client, fake):
    from aiohttp.test_utils import TestClient

    client = TestClient(fake)
    await client.start_server()
    yield client
    await client.close()


async def test_chat_response_hides_what_the_proxy_added_and_records_it(
    make_proxy, received, fake_client, tmp_path
):
    proxy = await make_proxy()
    r = await proxy.post(
        "/v1/chat/completions", json=CHAT, headers={"X-Rollout-Group": "g1", "X-Rollout-Id": "r1"}
    )
    assert r.status == 200
    got = await r.json()
    # The client sees exactly what the server gives a client that asked for nothing extra.
    plain = await direct(fake_client, "/v1/chat/completions", {**CHAT, "model": "fake-base"})
    assert without_ids(got) == without_ids(plain)
    assert got["prompt_token_ids"] is None and got["choices"][0]["token_ids"] is None
    assert got["choices"][0]["logprobs"] is None
    # Upstream was asked for what training needs, for the base model behind the alias.
    sent = received[0]["body"]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert sent["model"] == "fake-base"

    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert (row["group_id"], row["rollout_id"], row["attribution"]) == ("g1", "r1", "header")
    assert row["completion_token_ids"] == [100, 101, 102]
    assert row["completion_logprobs"] == pytest.approx([-0.01, -0.02, -0.03])
    assert row["prompt_token_ids"] and row["prompt_tokens"] == len(row["prompt_token_ids"])
    assert (row["model_requested"], row["model_served"], row["adapter_version"]) == (
        "policy",
        "fake-base",
        None,
    )
    assert row["finish_reason"] == "length" and row["http_status"] == 200 and not row["partial"]
    assert json.loads(row["request"]) == CHAT
    assert json.loads(row["response"])["choices"][0]["message"]["content"] == " w00 w01 w02"
    assert row["stream"] is False and row["logged"] is True and row["error"] is None


async def test_client_that_asks_for_logprobs_and_ids_gets_them(make_proxy, received):
    proxy = await make_proxy()
    r = await proxy.post(
        "/v1/chat/completions", json={**CHAT, "logprobs": True, "return_token_ids": True}
    )
    got = await r.json()
    assert got["choices"][0]["token_ids"] == [100, 101, 102]
    assert [e["logprob"] for e in got["choices"][0]["logprobs"]["content"]] == pytest.approx(
        [-0.01, -0.02, -0.03]
    )
    assert got["prompt_token_ids"]


async def test_stream_is_relayed_as_plain_vllm_would_send_it(
    make_proxy, fake_client, received, tmp_path
):
    proxy = await make_proxy()
    body = {**CHAT, "stream": True}
    r = await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Id": "s1"})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    got = sse_events(await r.text())
    plain = sse_events(
        await direct(fake_client, "/v1/chat/completions", {**body, "model": "fake-base"})
    )
    assert without_ids(got) == without_ids(plain)  # no usage chunk, fingerprint where it was
    assert got[-1] == "[DONE]" and got[-2]["system_fingerprint"] == FINGERPRINT
    assert received[0]["body"]["stream_options"] == {"include_usage": True}

    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["stream"] is True and row["rollout_id"] == "s1" and row["group_id"] == "s1"
    assert row["completion_token_ids"] == [100, 101, 102]
    assert row["completion_logprobs"] == pytest.approx([-0.01, -0.02, -0.03])
    assert row["prompt_tokens"] == len(row["prompt_token_ids"])  # from the usage chunk we hid
    assert json.loads(row["response"])["choices"][0]["message"] == {
        "role": "assistant",
        "content": " w00 w01 w02",
    }


async def test_stream_client_that_asks_for_usage_gets_it(make_proxy):
    proxy = await make_proxy()
    r = await proxy.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = sse_events(await r.text())
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 3


async def test_n_choices_without_ids_form_a_group_of_their_own(make_proxy, tmp_path):
    proxy = await make_proxy()
    for stream in (False, True):
        r = await proxy.post("/v1/chat/completions", json={**CHAT, "n": 3, "stream": stream})
        assert r.status == 200
        await r.read()
    found = await wait_for_rows(tmp_path / "data", 6)
    for stream in (False, True):
        group = [f for f in found if f["stream"] is stream]
        assert len({f["group_id"] for f in group}) == 1
        assert {f["rollout_id"] for f in group} == {
            f"{group[0]['request_id']}.{i}" for i in range(3)
        }
        assert [f["attribution"] for f in group] == ["choices"] * 3
        assert [f["completion_token_ids"] for f in group] == [
            [100 + 7 * i + k for k in range(3)] for i in range(3)
        ]


async def test_text_completions_streamed_and_whole(make_proxy, received, tmp_path):
    proxy = await make_proxy()
    body = {"model": "policy", "prompt": "Once", "max_tokens": 2}
    whole = await (await proxy.post("/v1/completions", json=body)).json()
    assert whole["choices"][0]["logprobs"] is None and whole["choices"][0]["token_ids"] is None
    assert received[0]["body"]["logprobs"] == 0  # text completions count top logprobs
    streamed = sse_events(
        await (await proxy.post("/v1/completions", json={**body, "stream": True})).text()
    )
    assert all(e == "[DONE]" or e["choices"][0]["prompt_token_ids"] is None for e in streamed)
    found = await wait_for_rows(tmp_path / "data", 2)
    for row in found:
        assert row["endpoint"] == "completions" and row["completion_token_ids"] == [100, 101]
        assert row["prompt_token_ids"] and row["completion_logprobs"] == pytest.approx(
            [-0.01, -0.02]
        )
        assert json.loads(row["response"])["choices"][0]["text"] == " w00 w01"


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_and_the_whole_conversation_are_captured(make_proxy, tmp_path, stream):
    proxy = await make_proxy()
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    messages = [
        *CHAT["messages"],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "nothing"},
    ]
    body = {**CHAT, "messages": messages, "tools": tools, "stream": stream}
    r = await proxy.post("/v1/chat/completions", json=body, headers={"X-Fake": "tool-call"})
    await r.read()
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    request = json.loads(row["request"])
    assert request["tools"] == tools and request["messages"] == messages
    message = json.loads(row["response"])["choices"][0]["message"]
    # Streamed, the call arrives as a name delta then argument pieces; both assemble alike.
    assert message["content"] is None
    assert message["tool_calls"] == [
        {
            "id": "chatcmpl-tool-0",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"query": "cats"}'},
        }
    ]
    assert row["completion_token_ids"] == [900, 901, 902] and row["finish_reason"] == "tool_calls"


async def test_attribution_headers_then_url_then_metadata(make_proxy, received, tmp_path):
    proxy = await make_proxy()
    meta = {**CHAT, "metadata": {"rollout_group": "gm", "rollout_id": "rm", "user": "kept"}}
    await proxy.post("/v1/chat/completions", json=meta)
    await proxy.post("/rollouts/gu/ru/v1/chat/completions", json=meta)
    await proxy.post(
        "/rollouts/gu/ru/v1/chat/completions",
        json=meta,
        headers={"X-Rollout-Group": "gh", "X-Rollout-Id": "rh"},
    )
    found = await wait_for_rows(tmp_path / "data", 3)
    assert [(f["group_id"], f["rollout_id"], f["attribution"]) for f in found] == [
        ("gm", "rm", "metadata"),
        ("gu", "ru", "url"),
        ("gh", "rh", "header"),
    ]
    # Our metadata keys never reach vLLM; the client's own metadata does.
    assert all(r["body"]["metadata"] == {"user": "kept"} for r in received)
    assert all("rollout_id" not in json.loads(f["request"]).get("metadata", {}) for f in found)


async def test_turns_of_a_rollout_are_numbered(make_proxy, tmp_path):
    proxy = await make_proxy()
    for _ in range(3):
        await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Id": "multi"})
    found = await wait_for_rows(tmp_path / "data", 3)
    assert [f["turn_index"] for f in found] == [0, 1, 2]


@pytest.mark.parametrize(
    "bad", ["", ".", "..", "x" * 257, "é" * 129, "tab\there", "nul\x00", "zw\u200b"]
)
async def test_bad_rollout_id_is_refused(make_proxy, received, bad):
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json={**CHAT, "metadata": {"rollout_id": bad}})
    assert r.status == 400
    assert (await r.json())["error"]["code"] == "invalid_rollout_id"
    assert received == []


async def test_logging_off_keeps_counts_but_no_bodies(make_proxy, tmp_path):
    proxy = await make_proxy()
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Log": "off"})
    assert r.status == 200
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["logged"] is False
    assert (
        row["request"] is None and row["response"] is None and row["completion_token_ids"] is None
    )
    assert row["completion_tokens"] == 3 and row["prompt_tokens"] > 0


async def test_other_paths_pass_through(make_proxy):
    proxy = await make_proxy()
    r = await proxy.get("/v1/models")
    assert r.status == 200 and (await r.json())["data"][0]["id"] == "fake-base"
    r = await proxy.get("/v1/no-such-thing")
    assert r.status == 404  # the upstream's answer, passed on
    assert (await proxy.get("/health")).status == 200


def test_the_proxy_never_imports_torch_or_litellm():
    import subprocess
    import sys

    code = (
        "import sys, overnight.cli, overnight.proxy, overnight.cli.serve; "
        "import overnight.proxy.launch.launcher; "
        "bad = [m for m in ('torch', 'litellm', 'transformers', 'peft') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


async def test_turns_alternating_between_two_proxies_are_numbered_once(make_proxy, tmp_path):
    # Two proxies on one data directory (as behind a load balancer, or --workers 2), then
    # a third started later (a restart): each numbers a turn from its conversation.
    proxies = [await make_proxy(), await make_proxy()]
    messages = list(CHAT["messages"])
    headers = {"X-Rollout-Group": "g", "X-Rollout-Id": "shared"}
    for turn in range(5):
        proxy = proxies[turn % 2] if turn < 4 else await make_proxy()
        r = await proxy.post(
            "/v1/chat/completions", json={**CHAT, "messages": messages}, headers=headers
        )
        reply = (await r.json())["choices"][0]["message"]
        messages = [*messages, reply, {"role": "user", "content": f"and then {turn}?"}]
    found = await wait_for_rows(tmp_path / "data", 5)
    assert [f["turn_index"] for f in found] == [0, 1, 2, 3, 4]
    assert len({f["proxy_id"] for f in found}) == 3
    # What the readers see: the judge, the trainer and `overnight show` in this order.
    from overnight.storage import open_db
    from overnight.view.display import load_rollout

    shown = load_rollout(open_db(tmp_path / "data"), "shared")
    assert [t.index for t in shown.turns] == [0, 1, 2, 3, 4]


def test_a_turn_is_numbered_by_the_model_turns_in_its_conversation():
    from overnight.proxy.capture.records import conversation_turns

    user, assistant = {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}
    reasoning = {"role": "assistant", "content": None, "reasoning": "r"}  # one Responses reply
    tool = {"role": "tool", "content": "t", "tool_call_id": "c"}
    assert conversation_turns({"messages": [user]}) == 0
    assert conversation_turns({"messages": [user, reasoning, assistant, tool, assistant]}) == 2
    assert conversation_turns({"prompt": "text completion"}) == 0
    assert conversation_turns({"messages": "not a list"}) == 0
