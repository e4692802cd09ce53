"""A multi-turn, tool-using agent written with the plain `openai` SDK.

It answers questions about a small bundled table of cities by calling a `lookup`
tool, and runs unchanged against OpenAI, a plain vLLM or the overnight proxy: only
OPENAI_BASE_URL and the rollout headers differ. Each task is attempted
`--group-size` times (a GRPO group); every call of one attempt carries the same
`X-Rollout-Id`. Against the proxy it also posts each attempt's reward (1 if the
final answer names the right value) and marks the attempt finished.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=unused \\
        python examples/tool_agent.py --model policy --tasks 3 --group-size 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import uuid

import httpx
import openai

CITIES = {
    "oslo": {"temperature": -3, "weather": "snow"},
    "lima": {"temperature": 19, "weather": "cloudy"},
    "cairo": {"temperature": 24, "weather": "sunny"},
    "perth": {"temperature": 31, "weather": "sunny"},
    "quito": {"temperature": 14, "weather": "rain"},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Current weather and temperature (Celsius) of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
SYSTEM = """\
You are the weather desk of a travel company. Travellers ask you about the current
weather in the cities they are going to, and you answer from live data only.

How to work:
- Always call the lookup tool for every city in the question before answering; never
  answer from memory, and never guess a city the traveller did not name.
- If the tool returns an error, check the spelling of the city and call it again once;
  if it still fails, say that the city is not covered.
- Temperatures are in degrees Celsius; give them as whole numbers.
- Keep the answer short and factual: no advice, no small talk.

When you know the answer, reply with exactly one line: 'ANSWER: <value>', where <value>
is the number or word that answers the question and nothing else."""


def lookup(arguments: str) -> str:
    try:
        city = str(json.loads(arguments).get("city", "")).strip().lower()
    except (ValueError, AttributeError):
        return json.dumps({"error": "arguments must be a JSON object with 'city'"})
    return json.dumps(CITIES.get(city, {"error": f"unknown city {city!r}"}))


def make_task(rng: random.Random) -> dict:
    city = rng.choice(sorted(CITIES))
    return {
        "question": f"What is the temperature in {city.title()} right now?",
        "answer": str(CITIES[city]["temperature"]),
    }


async def run_rollout(
    client: openai.AsyncOpenAI, model: str, task: dict, group: str, max_turns: int, max_tokens: int
) -> dict:
    """One attempt: tool calls and reminders until an answer or `max_turns`."""
    rollout = f"{group}.{uuid.uuid4().hex[:8]}"
    headers = {"X-Rollout-Group": group, "X-Rollout-Id": rollout}
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task["question"]},
    ]
    answer = None
    for _ in range(max_turns):
        reply = await client.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            max_tokens=max_tokens,
            temperature=1.0,
            extra_headers=headers,
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": lookup(call.function.arguments),
                    }
                )
            continue
        text = message.content or ""
        if "ANSWER:" in text:
            answer = text.split("ANSWER:", 1)[1].strip()
            break
        messages.append(
            {"role": "user", "content": "Call the lookup tool, or reply with 'ANSWER: <value>'."}
        )
    reward = 1.0 if answer is not None and task["answer"] in answer.split() else 0.0
    return {
        "rollout_id": rollout,
        "group": group,
        "turns": sum(m["role"] == "assistant" for m in messages),
        "answer": answer,
        "reward": reward,
    }


async def post_reward(base_url: str, api_key: str, result: dict) -> None:
    """The proxy's reward and finish endpoints; other servers do not have them."""
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as http:
        r = await http.post(
            f"/rollouts/{result['rollout_id']}/reward",
            json={"reward": result["reward"], "metrics": {"turns": result["turns"]}},
        )
        r.raise_for_status()
        (await http.post(f"/rollouts/{result['rollout_id']}/finish")).raise_for_status()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("OVERNIGHT_MODEL", "policy"))
    parser.add_argument("--tasks", type=int, default=3, help="distinct tasks (rollout groups)")
    parser.add_argument("--group-size", type=int, default=4, help="attempts per task")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-rewards", action="store_true", help="do not post rewards (plain servers)"
    )
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()

    base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    api_key = os.environ.get("OPENAI_API_KEY", "unused")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    rng = random.Random(args.seed)
    run = uuid.uuid4().hex[:6]
    limit = asyncio.Semaphore(args.concurrency)

    async def attempt(task: dict, group: str) -> dict:
        async with limit:
            result = await run_rollout(
                client, args.model, task, group, args.max_turns, args.max_tokens
            )
            if not args.no_rewards:
                await post_reward(base_url, api_key, result)
            return result

    jobs = []
    for t in range(args.tasks):
        task = make_task(rng)
        jobs += [attempt(task, f"weather-{run}-{t}") for _ in range(args.group_size)]
    results = await asyncio.gather(*jobs)
    for r in results:
        print(
            f"{r['rollout_id']}: {r['turns']} turn(s), answer {r['answer']!r}, reward {r['reward']}"
        )
    mean = sum(r["reward"] for r in results) / len(results)
    print(f"{len(results)} rollouts in {args.tasks} groups, mean reward {mean:.2f}")


if __name__ == "__main__":
    asyncio.run(main())
