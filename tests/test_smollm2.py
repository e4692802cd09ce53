"""The real model, SmolLM2-135M-Instruct, behind the proxy: what vLLM sampled is what the
trainer computes, a conversation renders as vLLM saw it, and the model judges its own
groups through litellm (RULER with a local judge: no hosted API, no key).

One vLLM serves it for the session (`smollm2_server`, tests/vllm_fixtures.py); the
records are logged once for the module (`logged`) and read by every test. Learning on
it, over nights, is the demo's test (tests/test_demo.py).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from overnight.examples.rewards import bare_sum
from overnight.examples.sum_agent import HELD_OUT, SYSTEM

from .helpers import rows, wait_for_rows

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# How agents sample: the trainer must compute the distribution vLLM sampled from.
SAMPLED_AS = [{"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.0}]
QUESTIONS = HELD_OUT[:3]  # sums: a reward function scores them, RULER ranks them
ATTEMPTS = 2  # per group: the least that gives a group something to compare


def sum_chat(question: str, **params) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": "policy", "messages": messages, "max_tokens": 24, **params}


@pytest.fixture(scope="module")
def logged(smollm2_server, tmp_path_factory):
    """Records on the real model through the proxy: single calls at two samplings (groups
    of ATTEMPTS), an n=2 request, and two-turn conversations (one rollout each, a group
    of 2); every rollout finished. Returns the data directory."""
    from aiohttp.test_utils import TestClient, TestServer

    from overnight.config import ProxyConfig
    from overnight.proxy import create_app

    data = tmp_path_factory.mktemp("smollm2") / "data"
    config = ProxyConfig(upstream=smollm2_server.url, data_dir=data, commit_interval=0.0)

    async def log() -> None:
        async with TestClient(TestServer(create_app(config))) as proxy:

            async def call(group: str | None, rollout: str | None, body: dict) -> dict:
                headers = {"X-Rollout-Group": group, "X-Rollout-Id": rollout} if group else {}
                r = await proxy.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status == 200, await r.text()
                return await r.json()

            jobs = []
            for k, params in enumerate(SAMPLED_AS):
                for q, question in enumerate(QUESTIONS):
                    group = f"sums-{k}-{q}"
                    jobs += [call(group, f"{group}.{i}", sum_chat(question, **params))
                             for i in range(ATTEMPTS)]  # fmt: skip
            # n=2 with no ids: a group of its own two choices (docs/wire.md)
            jobs.append(call(None, None, sum_chat(QUESTIONS[0], temperature=1.0, n=2)))
            await asyncio.gather(*jobs)
            for i in range(2):  # a second turn repeats the first and its reply
                first = sum_chat(QUESTIONS[1], temperature=1.0)
                reply = (await call("talk", f"talk.{i}", first))["choices"][0]["message"]
                second = {**first, "messages": [*first["messages"], reply,
                                                {"role": "user", "content": "And plus 1?"}]}  # fmt: skip
                await call("talk", f"talk.{i}", second)
                await proxy.post(f"/v1/rollouts/talk.{i}/reward", json={"reward": float(i)})
            ids = [
                r["rollout_id"] for r in rows(data, "SELECT DISTINCT rollout_id FROM completions")
            ]
            for rollout in ids:
                await proxy.post(f"/v1/rollouts/{rollout}/finish")
            await wait_for_rows(data, len(SAMPLED_AS) * len(QUESTIONS) * ATTEMPTS + 2 + 4)

    asyncio.run(log())
    return data


def test_the_prepared_folder_is_reused_and_verified(smollm2_dir):
    from overnight.models.smollm2 import MARKER, prepare_smollm2

    marker = json.loads((smollm2_dir / MARKER).read_text())
    assert "Paris" in marker["verified"]["answer"]  # the known greedy answer, checked
    assert 130e6 < marker["verified"]["parameters"] < 140e6
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert prepare_smollm2(smollm2_dir, say=pytest.fail) == smollm2_dir  # nothing rebuilt
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_the_trainer_computes_what_vllm_sampled(logged, smollm2_dir):
    """GRPO's first step on the real template and vocabulary, over single calls at two
    samplings, n=2 choices and two-turn conversations merged into one sequence each: the
    trainer's logprobs before any update equal vLLM's, so every first-step ratio is 1."""
    from overnight.config import TrainConfig
    from overnight.trainer.train import train

    _score_with_the_reward_function(logged)
    config = TrainConfig(
        base_model=str(smollm2_dir),
        lora_rank=8,
        groups_per_step=64,  # one step: every record before the first update
        gate="off",
        watch=False,
    )
    lines: list[str] = []
    train(logged, config, proxy_url=None, promote=False, say=lines.append)
    (run,) = rows(logged, "SELECT * FROM training_runs")
    assert run["steps"] == 1, lines
    assert run["max_logprob_gap"] < 1e-4, lines  # measured: 6.6e-05 nats
    (on_policy,) = [line for line in lines if line.startswith("on-policy:")]
    low, high = (float(x) for x in on_policy.split("first-step ratios ")[1].split(" to "))
    assert 0.9999 < low <= high < 1.0001, on_policy
    # The two-turn rollouts trained as one sequence each: the second turn's prompt holds
    # the first turn's prompt and reply as vLLM tokenised them.
    turns = rows(logged, "SELECT prompt_token_ids, completion_token_ids FROM completions "
                 "WHERE rollout_id = 'talk.0' ORDER BY turn_index")  # fmt: skip
    first, second = turns
    assert second["prompt_token_ids"][: len(first["prompt_token_ids"])] == first["prompt_token_ids"]
    print(f"smollm2 parity: {on_policy}; max gap {run['max_logprob_gap']:.2g} nats")


def test_the_template_renders_each_turn_as_vllm_saw_it(logged, smollm2_dir):
    """`train --sft` renders a conversation from its text with the local template: on the
    real model its prompt ids are the ones vLLM logged, turn by turn. A reply's ids are
    vLLM's too whenever the model sampled them as the tokenizer would split the text; a
    model may also sample a split the tokenizer never makes (" \n\n" as one token where
    the tokenizer gives " \n", "\n"), which text alone cannot recover: then the text is
    the same and the ids differ, which is why GRPO trains on the logged ids, never on a
    render."""
    from transformers import AutoTokenizer

    from overnight.trainer.grpo.render import render_turn

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    records = rows(logged, "SELECT request, response, prompt_token_ids, completion_token_ids, "
                   "finish_reason FROM completions WHERE choice_index = 0")  # fmt: skip
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    finished = exact = 0
    for record in records:
        reply = json.loads(record["response"])["choices"][0]["message"]
        turn = render_turn(tokenizer, json.loads(record["request"]), reply)
        assert turn.prompt_ids == record["prompt_token_ids"]
        sampled = record["completion_token_ids"]
        if record["finish_reason"] == "stop":  # the reply as sampled, its <|im_end|> too
            wanted, text_ids = sampled, sampled[:-1]
            finished += 1
        else:  # cut at max_tokens: the template ends the turn that never ended (so
            # `train --sft` skips such a reply: render.py's `_turn`)
            assert record["finish_reason"] == "length"
            wanted, text_ids = [*sampled, end_of_turn], sampled
            as_sampled = tokenizer.decode(text_ids)
            if as_sampled.endswith("\ufffd"):  # cut inside a character's bytes: vLLM holds
                # the part back from the text, so no render from the text can give it back
                assert as_sampled.startswith(reply["content"])
                assert tokenizer.decode(turn.completion_ids) == reply["content"] + "<|im_end|>"
                continue
        assert tokenizer.decode(turn.completion_ids) == tokenizer.decode(wanted)
        if tokenizer.encode(tokenizer.decode(text_ids), add_special_tokens=False) == text_ids:
            assert turn.completion_ids == wanted  # sampled as the tokenizer splits it
            exact += 1
    assert exact >= len(records) // 2, (exact, len(records))  # the split rarely differs
    print(f"smollm2 render: {len(records)} prompts as vLLM's ids; {len(records)} replies as "
          f"vLLM's text, {exact} as its very ids ({finished} finished, the rest cut at "
          "max_tokens)")  # fmt: skip


def test_the_real_model_judges_its_own_groups_locally(logged, smollm2_server):
    """RULER with SmolLM2 as the judge, through litellm to the local vLLM: every group
    gets scores or a recorded failure, and its agreement with the reward function is
    measured (a 135M judge is weak: stated, not held to a threshold)."""
    from overnight.config import JudgeConfig
    from overnight.judge.run import run_judge

    groups = [f"sums-{k}-{q}" for k in range(len(SAMPLED_AS)) for q in range(len(QUESTIONS))]
    config = JudgeConfig(model="openai/smollm2", base_url=smollm2_server.url + "/v1",
                         api_key="unused", max_tokens=160)  # fmt: skip
    asyncio.run(run_judge(logged, config, groups=groups, settle_seconds=0, progress=False))
    judged = rows(logged, "SELECT group_id, scores, error FROM judgments WHERE judge_model = ?",
                  ["openai/smollm2"])  # fmt: skip
    assert sorted(j["group_id"] for j in judged) == sorted(groups)
    agree, pairs = _agreement(logged, judged)
    failed = sum(j["error"] is not None for j in judged)
    print(f"smollm2 as RULER judge: {len(judged) - failed} of {len(judged)} groups scored, "
          f"pairwise agreement with bare_sum {agree}/{pairs}")  # fmt: skip


def _score_with_the_reward_function(data) -> None:
    from overnight.judge.rewards import RewardFunction
    from overnight.judge.run import run_judge

    bare = RewardFunction("overnight.examples.rewards:bare_sum")
    asyncio.run(run_judge(data, None, bare, settle_seconds=0, progress=False))


def _agreement(data, judged: list[dict]) -> tuple[int, int]:
    """Pairs of rollouts in a group ordered the same way by RULER and by bare_sum (ties in
    either left out): (agreeing pairs, pairs)."""
    agree = pairs = 0
    for judgment in judged:
        if judgment["error"] is not None:
            continue
        scores = {s["rollout_id"]: s["score"] for s in judgment["scores"] or []}
        replies = {
            r["rollout_id"]: bare_sum(
                {
                    "messages": [
                        json.loads(r["request"])["messages"][1],
                        json.loads(r["response"])["choices"][0]["message"],
                    ]
                }
            )  # fmt: skip
            for r in rows(
                data,
                "SELECT rollout_id, request, response FROM completions WHERE group_id = ?",
                [judgment["group_id"]],
            )  # fmt: skip
        }
        ids = sorted(set(scores) & set(replies))
        for i, a in enumerate(ids):
            for b in ids[i + 1 :]:
                judge, truth = scores[a] - scores[b], replies[a] - replies[b]
                if judge and truth:
                    pairs += 1
                    agree += (judge > 0) == (truth > 0)
    return agree, pairs


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_its_template_has_no_tools_so_sft_refuses_a_tool_call_turn(smollm2_dir):
    """SmolLM2's chat template renders no tools block and no tool calls (docs/clients.md):
    the tools a request sends never reach the model, and a tool-calling reply would render
    as an empty turn, so `train --sft` skips it with its reason instead of teaching it."""
    from transformers import AutoTokenizer

    from overnight.trainer.grpo.data import DataError
    from overnight.trainer.grpo.logged_turns import chat_ids
    from overnight.trainer.grpo.render import render_turn

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert chat_ids(tokenizer, messages, [WEATHER], True) == chat_ids(
        tokenizer, messages, None, True
    )
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    with pytest.raises(DataError, match="does not render tool calls"):
        render_turn(tokenizer, {"messages": messages, "tools": [WEATHER]}, reply)
    text = render_turn(tokenizer, {"messages": messages}, {"role": "assistant", "content": "Sunny"})
    assert tokenizer.decode(text.completion_ids) == "Sunny<|im_end|>"
