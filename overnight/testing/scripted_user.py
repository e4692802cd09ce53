"""A scripted user who talks to the sum agent's model as a person would, and knows (hidden
from the trainer) whether each answer was right.

It asks a sum (examples/sum_agent.py's questions and system prompt) and reads the answer:
right when its last number is the sum (`bare_sum` above 0, examples/rewards.py; "7",
"3 + 4 = 7"), wrong otherwise (a wrong sum, no number, an explanation cut off before
it). Then it reacts in its next message, as the signals' rules expect people to and
sometimes not (judge/signals.py, docs/signals.md): right, it thanks or moves on to the
next sum; wrong, it corrects, complains, asks again, or doubts in words the rules do not
know ("Are you sure?"); now and then it regenerates instead (the same messages again) or
leaves without a word. A user who `corrects` (the hindsight trial's) says the right sum
instead when displeased ("No, it's 7."): words a scalar reward throws away. A
conversation is at most `turns` answers; the reaction to the last one is sent too, as a
request of its own whose answer nobody reads.

Each answer is its own rollout (`X-Rollout-Id`, no group: a group of one, as production
traffic is), so the true reward can be posted for it where a trial wants the posted side.
Deterministic for a seed: its choices, and the model's (each request carries a seed).
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from overnight.examples.rewards import bare_sum
from overnight.examples.sum_agent import SYSTEM

# The answer is what the user's reaction is about; {next} is the next sum, {q} this one.
PLEASED = ["Thanks! {next}", "great, thank you. {next}", "Perfect. {next}", "{next}",
           "ok. Next: {next}", "that works. {next}"]  # fmt: skip
DISPLEASED = ["No, that's wrong. {q}", "That is not what I asked. {q}", "{q}",
              "Wrong, try again: {q}", "Are you sure? {q}", "hm, {q}"]  # fmt: skip
# A user who corrects with the answer (issue 48: learn from what they said); {sum} is the
# right sum. Each opens as the rules read a correction.
CORRECTING = ["No, it's {sum}.", "Wrong, the answer is {sum}.", "No, {sum}.",
              "That's not right, it's {sum}.", "no. it is {sum}"]  # fmt: skip
LEAVES = 0.1  # after any answer, the user may leave without a word
REGENERATES = 0.15  # displeased, the user may ask again for the same messages

# (the request's body, its headers) -> the chat completion's JSON answer
Chat = Callable[[dict, dict], Awaitable[dict]]


@dataclass
class Conversation:
    """What one conversation's user knows: each answer's rollout and true reward."""

    truth: dict[str, float] = field(default_factory=dict)  # rollout -> 1.0 right, 0.0 wrong
    reacted: set[str] = field(default_factory=set)  # rollouts the user reacted to


def true_reward(question: str, reply: str) -> float:
    """1.0 when the reply's last number is the question's sum, else 0.0."""
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    return 1.0 if bare_sum({"messages": messages}) > 0 else 0.0


def right_sum(question: str) -> int:
    """The sum a question asks for ("What is 3 plus 4?" -> 7)."""
    a, b = (int(n) for n in re.findall(r"\d+", question)[:2])
    return a + b


async def converse(
    chat: Chat,
    conversation_id: str,
    questions: list[str],
    seed: int,
    *,
    turns: int = 3,
    max_tokens: int = 24,
    temperature: float = 0.8,
    corrects: bool = False,
) -> Conversation:
    """One conversation over `questions` (asked in order, each until the user is pleased
    or the turns run out). `corrects`: displeased, the user says the right sum
    (CORRECTING) instead of the usual reactions."""
    rng = random.Random(f"{seed}:{conversation_id}")
    out = Conversation()
    pending = list(questions)
    question = pending.pop(0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    body = {"model": "policy", "max_tokens": max_tokens, "temperature": temperature}
    for t in range(turns + 1):
        rollout = f"{conversation_id}-{t}"
        last = t == turns  # the reaction to the last answer, sent; its answer unread
        # A seed per request (vLLM's): the same day again, whatever else runs at once.
        sampled = {**body, "messages": messages, "seed": rng.randrange(2**31)}
        answer = await chat(sampled, {"X-Rollout-Id": rollout})
        if last:
            break
        reply = answer["choices"][0]["message"].get("content") or ""
        out.truth[rollout] = true_reward(question, reply)
        pleased = out.truth[rollout] > 0
        style = rng.random()
        if style < LEAVES:
            break
        out.reacted.add(rollout)
        if not pleased and style < LEAVES + REGENERATES:
            continue  # the same messages again: a regenerate
        next_question = pending.pop(0) if pleased else question
        words = rng.choice(PLEASED if pleased else CORRECTING if corrects else DISPLEASED)
        reaction = words.format(next=next_question, q=question, sum=right_sum(question))
        messages = [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": reaction},
        ]
        question = next_question
    return out


async def converse_all(
    chat: Chat, prefix: str, questions: list[str], conversations: int, seed: int, **options
) -> Conversation:
    """`conversations` conversations at once (eight in flight), each over enough of
    `questions` (drawn by the seed) never to run out; everything the user knows, merged."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(8)

    async def one(i: int, asked: list[str]) -> Conversation:
        async with limit:
            return await converse(chat, f"{prefix}{i}", asked, seed, **options)

    drawn = [rng.sample(questions, options.get("turns", 3) + 1) for _ in range(conversations)]
    merged = Conversation()
    for c in await asyncio.gather(*(one(i, q) for i, q in enumerate(drawn))):
        merged.truth.update(c.truth)
        merged.reacted |= c.reacted
    return merged
