"""A multi-turn search-and-answer agent over a bundled corpus: RULER's use case.

An internal help desk: the agent answers a colleague's question from the company
handbook (examples/handbook.json, a dozen short pages), with two tools: `search`
(pages whose words match the query best) and `read` (one page in full). There is no
reward code: how good an answer is (found the right page? answered what was asked?
invented nothing?) is what an LLM judge reads off the conversations, comparing the
attempts of a group with each other (RULER). The agent only posts `finish`.

Written with the plain `openai` SDK: it runs unchanged against OpenAI, a plain vLLM
or the proxy; only OPENAI_BASE_URL and the rollout headers differ.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/search_agent.py --questions 4 --group-size 4
    overnight judge --judge-model openai/gpt-4.1      # RULER scores each group
    overnight train                                   # and the nightly run trains on it
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import uuid
from pathlib import Path

import httpx
import openai

HANDBOOK = json.loads((Path(__file__).with_name("handbook.json")).read_text())
QUESTIONS = [
    "How many days of paid leave do new employees get?",
    "Who approves travel over 2,000 euros?",
    "What is the deadline for submitting expenses?",
    "Can I work from another country, and for how long?",
    "How do I get a new laptop?",
    "What happens to unused leave at the end of the year?",
    "Which hotel price limit applies in Paris?",
    "Who do I call if the office alarm goes off at night?",
]
SYSTEM = """\
You are the help desk of Acme Robotics. Colleagues ask you questions about the company
handbook, and you answer from the handbook only.

How to work:
- Call `search` with the key words of the question, then `read` the page that looks
  right. Search again with other words if nothing fits.
- Answer only with what the page says; if the handbook does not cover it, say so.
- Name the page you used, like this: (source: travel-policy).
- Keep it to two or three sentences."""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Find handbook pages by key words; returns page ids and titles.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read one handbook page in full.",
            "parameters": {
                "type": "object",
                "properties": {"page": {"type": "string"}},
                "required": ["page"],
            },
        },
    },
]


def words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def search(query: str) -> list[dict]:
    """The three pages sharing the most words with the query (a tiny keyword index)."""
    wanted = words(query)
    scored = sorted(HANDBOOK, key=lambda p: -len(wanted & words(p["title"] + " " + p["text"])))
    return [{"page": p["id"], "title": p["title"]} for p in scored[:3]]


def call_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments or "{}")
        if not isinstance(args, dict):
            raise ValueError
    except ValueError:
        return json.dumps({"error": "arguments must be a JSON object"})
    if name == "search":
        return json.dumps(search(str(args.get("query", ""))))
    if name == "read":
        page = next((p for p in HANDBOOK if p["id"] == args.get("page")), None)
        return json.dumps(page or {"error": f"no page {args.get('page')!r}; search first"})
    return json.dumps({"error": f"unknown tool {name!r}"})


async def run_rollout(
    client: openai.AsyncOpenAI,
    model: str,
    question: str,
    group: str,
    max_turns: int,
    max_tokens: int,
) -> dict:
    """One attempt: tool calls until the model answers in plain text, or `max_turns`."""
    rollout = f"{group}.{uuid.uuid4().hex[:8]}"
    headers = {"X-Rollout-Group": group, "X-Rollout-Id": rollout}
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    answer = None
    tool_calls = 0
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
        if not message.tool_calls:
            answer = message.content or ""
            break
        for call in message.tool_calls:
            tool_calls += 1
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call.id,
                    "content": call_tool(call.function.name, call.function.arguments),
                }
            )
    return {"rollout_id": rollout, "tool_calls": tool_calls, "answer": answer}


async def finish(base_url: str, api_key: str, rollout_id: str) -> None:
    """The proxy's finish endpoint (other servers do not have it): the group can be
    judged as soon as all its attempts are finished."""
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as http:
        (await http.post(f"/rollouts/{rollout_id}/finish")).raise_for_status()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("OVERNIGHT_MODEL", "policy"))
    parser.add_argument("--questions", type=int, default=4, help="distinct questions (groups)")
    parser.add_argument("--group-size", type=int, default=4, help="attempts per question")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--no-finish", action="store_true", help="plain servers: do not post")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--run", default=uuid.uuid4().hex[:6], help="tag in the group ids")
    args = parser.parse_args()

    base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    api_key = os.environ.get("OPENAI_API_KEY", "unused")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    run = args.run
    limit = asyncio.Semaphore(args.concurrency)

    async def attempt(question: str, group: str) -> dict:
        async with limit:
            result = await run_rollout(
                client, args.model, question, group, args.max_turns, args.max_tokens
            )
            if not args.no_finish:
                await finish(base_url, api_key, result["rollout_id"])
            return result

    jobs = []
    for q in range(args.questions):
        question = QUESTIONS[q % len(QUESTIONS)]
        jobs += [attempt(question, f"handbook-{run}-{q}") for _ in range(args.group_size)]
    results = await asyncio.gather(*jobs)
    for r in results:
        print(f"{r['rollout_id']}: {r['tool_calls']} tool call(s), answer {r['answer']!r:.80}")
    print(f"{len(results)} rollouts in {args.questions} groups")


if __name__ == "__main__":
    asyncio.run(main())
