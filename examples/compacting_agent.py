"""The help-desk agent of search_agent.py, with a history it compacts every few turns.

Long-running agents keep their context short by summarising it: every
`--compact-every` turns this one asks the model for notes on its work so far (a call
of its own, with its own system prompt), then starts again from the system prompt,
the question and those notes. Its turns therefore do not all extend each other, and
the last turn alone is a fragment of what the attempt did: the judge renders every
turn of a rollout (judge/trajectories.py), the summary call and the work before it
included, to score the whole attempt.

Written with the plain `openai` SDK, like the other examples: it runs unchanged
against OpenAI, a plain vLLM or the proxy; only OPENAI_BASE_URL and the rollout
headers differ.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python examples/compacting_agent.py --questions 4 --group-size 4
    overnight judge --judge-model openai/gpt-4.1      # RULER reads every turn
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example's tools
from search_agent import QUESTIONS, SYSTEM, TOOLS, call_tool, finish  # noqa: E402

SUMMARISER = """\
You keep notes for a help-desk agent whose conversation is about to be cut short.
From the transcript, write what it has found so far (page ids and what they say) and
what it still has to find. Five lines at most; facts only."""


def transcript(messages: list[dict]) -> str:
    """The conversation as plain text for the summariser (no tool-call plumbing)."""
    lines = []
    for m in messages[1:]:  # not the agent's system prompt
        for call in m.get("tool_calls") or ():
            lines.append(
                f"{m['role']} calls {call['function']['name']}{call['function']['arguments']}"
            )
        if m.get("content"):
            lines.append(f"{m['role']}: {m['content']}")
    return "\n".join(lines)


async def compact(
    client: openai.AsyncOpenAI, model: str, messages: list[dict], headers: dict, max_tokens: int
) -> list[dict]:
    """The history replaced by the system prompt, the question and notes on the rest."""
    reply = await client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": SUMMARISER},
            {"role": "user", "content": transcript(messages)},
        ],
        max_tokens=max_tokens,
        temperature=0.0,
        extra_headers=headers,  # the same rollout: the judge sees this call too
    )
    notes = reply.choices[0].message.content or ""
    return [
        messages[0],
        messages[1],
        {
            "role": "user",
            "content": f"Notes on your work so far (earlier steps compacted):\n{notes}",
        },
    ]


async def run_rollout(
    client: openai.AsyncOpenAI,
    model: str,
    question: str,
    group: str,
    max_turns: int = 8,
    max_tokens: int = 200,
    compact_every: int = 3,
) -> dict:
    """One attempt: tool calls until a plain-text answer, compacting every few turns."""
    rollout = f"{group}.{uuid.uuid4().hex[:8]}"
    headers = {"X-Rollout-Group": group, "X-Rollout-Id": rollout}
    messages: list[dict] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    answer, tool_calls, compactions = None, 0, 0
    for turn in range(max_turns):
        if turn and turn % compact_every == 0:
            messages = await compact(client, model, messages, headers, max_tokens)
            compactions += 1
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
            result = call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {
        "rollout_id": rollout,
        "tool_calls": tool_calls,
        "compactions": compactions,
        "answer": answer,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.environ.get("OVERNIGHT_MODEL", "policy"))
    parser.add_argument("--questions", type=int, default=4, help="distinct questions (groups)")
    parser.add_argument("--group-size", type=int, default=4, help="attempts per question")
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--compact-every", type=int, default=3, help="turns between summaries")
    parser.add_argument("--no-finish", action="store_true", help="plain servers: do not post")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--run", default=uuid.uuid4().hex[:6], help="tag in the group ids")
    args = parser.parse_args()

    base_url = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    api_key = os.environ.get("OPENAI_API_KEY", "unused")
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    limit = asyncio.Semaphore(args.concurrency)

    async def attempt(question: str, group: str) -> dict:
        async with limit:
            result = await run_rollout(
                client,
                args.model,
                question,
                group,
                args.max_turns,
                args.max_tokens,
                args.compact_every,
            )
            if not args.no_finish:
                await finish(base_url, api_key, result["rollout_id"])
            return result

    jobs = []
    for q in range(args.questions):
        question = QUESTIONS[q % len(QUESTIONS)]
        jobs += [attempt(question, f"compact-{args.run}-{q}") for _ in range(args.group_size)]
    results = await asyncio.gather(*jobs)
    for r in results:
        print(
            f"{r['rollout_id']}: {r['tool_calls']} tool call(s), {r['compactions']} "
            f"compaction(s), answer {r['answer']!r:.80}"
        )
    print(json.dumps({"rollouts": len(results), "groups": args.questions}))


if __name__ == "__main__":
    asyncio.run(main())
