"""A verifiable agent for a real small model: add two numbers, reply with the sum alone.

An assistant whose answers go straight into a calculator's display: "7" is right,
"5 + 2 = 7" or "The sum of 5 and 2 is 7." make the display fail. SmolLM2-135M-Instruct
knows its single-digit sums but, untrained, never answers with the number alone (it
explains, or writes the equation); the reward (`examples/rewards.py:bare_sum`) gives 1 for
the bare right number, a little for the right number inside a sentence (less the longer
the sentence), 0 for a wrong one. Written with the plain `openai` SDK: only
OPENAI_BASE_URL and the rollout headers tie it to overnight.

The questions are the sums of two digits, split once into the ones the agent asks every
day (its traffic: groups of `--group-size` attempts, which nights train on) and the
held-out ones (`--held-out`: each asked `--group-size` times, each time a group of one,
which no night trains on: the day's measure of what the policy learned, 64 samples by
default, since 16 measured it too noisily; and the gate's prompts).

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/sum_agent.py --tasks 16 --group-size 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import uuid

import httpx
import openai

SYSTEM = "Reply with the number only."
QUESTION = "What is {a} plus {b}?"
# Every ordered pair of digits 1..9, split once (a fixed seed) into a fifth held out and
# the rest asked by day; the two sets never share a pair.
_PAIRS = [(a, b) for a in range(1, 10) for b in range(1, 10)]
random.Random(7).shuffle(_PAIRS)
HELD_OUT = [QUESTION.format(a=a, b=b) for a, b in _PAIRS[:16]]
ASKED = [QUESTION.format(a=a, b=b) for a, b in _PAIRS[16:]]


async def attempt(
    client: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
    model: str,
    question: str,
    group: str,
    args: argparse.Namespace,
    marked: dict[str, str],
) -> str:
    rollout = f"{group}.{uuid.uuid4().hex[:8]}"
    reply = await client.chat.completions.create(
        model=model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        extra_headers={"X-Rollout-Group": group, "X-Rollout-Id": rollout, **marked},
    )
    # Tell the proxy this attempt is over; scoring happens in the nightly batch.
    (await http.post(f"/rollouts/{rollout}/finish")).raise_for_status()
    return reply.choices[0].message.content or ""


def measurement_headers() -> dict[str, str]:
    """The held-out questions are the demo's measurement, not an agent's traffic: marked
    as overnight's own (`eval`), so that `overnight ls` and /ui list the agent's groups
    first. The proxy honours the mark from the operator only: with its admin token
    (OVERNIGHT_ADMIN_TOKEN), or from loopback where it has none (docs/operations.md)."""
    headers = {"X-Rollout-Origin": "eval"}
    token = os.environ.get("OVERNIGHT_ADMIN_TOKEN")
    return {**headers, "X-Rollout-Origin-Token": token} if token else headers


def day_questions(run: str, tasks: int) -> list[str]:
    """The day's `tasks` questions, drawn from ASKED by the run's tag (a new mix daily)."""
    return random.Random(run).sample(ASKED, min(tasks, len(ASKED)))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="policy")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--run", default=uuid.uuid4().hex[:6], help="tag in the group ids")
    parser.add_argument(
        "--held-out", action="store_true", help="ask the held-out questions instead"
    )
    args = parser.parse_args()
    base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    api_key = os.environ.get("OPENAI_API_KEY", "unused")
    # A CPU-served model answers a day's burst in tens of seconds: no 5-second defaults.
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=300)
    if args.held_out:  # each question --group-size times, each time a group of one
        work = [(q, f"heldout-{args.run}-{i}-{k}")
                for i, q in enumerate(HELD_OUT) for k in range(args.group_size)]  # fmt: skip
        size, marked = 1, measurement_headers()
    else:
        questions = day_questions(args.run, args.tasks)
        work = [(q, f"sums-{args.run}-{i}") for i, q in enumerate(questions)]
        size, marked = args.group_size, {}
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=300
    ) as http:
        jobs = [
            attempt(client, http, args.model, question, group, args, marked)
            for question, group in work
            for _ in range(size)
        ]
        replies = await asyncio.gather(*jobs)
    bare = sum(r.strip().rstrip(".").isdigit() for r in replies) / max(len(replies), 1)
    print(f"{len(replies)} replies in {len(work)} groups; bare numbers: {bare:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
