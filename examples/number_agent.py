"""A verifiable agent for the tiny model: it must answer with numbers only.

A form-filling assistant whose answers go straight into numeric fields: any word that
is not a number is wasted. The reward (`examples/rewards.py:numbers_only`) is the share
of words in the reply that are whole numbers, something even the tiny local model can
learn in a few nights. Written with the plain `openai` SDK: only OPENAI_BASE_URL and
the rollout headers tie it to overnight.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/number_agent.py --tasks 8 --group-size 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid

import httpx
import openai

SYSTEM = "You fill in numeric form fields. Reply with numbers only."
QUESTIONS = [
    "How many cats?",
    "What year is it?",
    "How old are you?",
    "How many days?",
    "Pick a number.",
    "How far is it?",
    "What time is it?",
    "How tall?",
]


async def attempt(
    client: openai.AsyncOpenAI,
    http: httpx.AsyncClient,
    model: str,
    question: str,
    group: str,
    max_tokens: int,
    top_k: int | None = None,
) -> str:
    rollout = f"{group}.{uuid.uuid4().hex[:8]}"
    reply = await client.chat.completions.create(
        model=model,
        max_tokens=max_tokens,
        temperature=1.0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        extra_headers={"X-Rollout-Group": group, "X-Rollout-Id": rollout},
        extra_body={"top_k": top_k} if top_k else None,
    )
    # Tell the proxy this attempt is over; scoring happens in the nightly batch.
    (await http.post(f"/rollouts/{rollout}/finish")).raise_for_status()
    return reply.choices[0].message.content or ""


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="policy")
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--run", default=uuid.uuid4().hex[:6], help="tag in the group ids")
    # vLLM's top_k (not in OpenAI's API): the tiny random model spreads its probability
    # over the whole vocabulary, where a trained model is peaked; 50 makes it behave so.
    parser.add_argument("--top-k", type=int, default=None)
    args = parser.parse_args()
    base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    api_key = os.environ.get("OPENAI_API_KEY", "unused")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    async with httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}
    ) as http:
        jobs = [
            attempt(
                client,
                http,
                args.model,
                QUESTIONS[t % len(QUESTIONS)],
                f"numbers-{args.run}-{t}",
                args.max_tokens,
                args.top_k,
            )
            for t in range(args.tasks)
            for _ in range(args.group_size)
        ]
        replies = await asyncio.gather(*jobs)
    words = [w for r in replies for w in r.split()]
    share = sum(w.isdigit() for w in words) / max(len(words), 1)
    print(f"{len(replies)} replies in {args.tasks} groups; numeric words: {share:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
