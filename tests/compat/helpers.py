"""What every framework's agent shares: the task, its tool, its structured answer, and
the checks on the rows the proxy logged."""

from __future__ import annotations

import json

from pydantic import BaseModel

GROUP = "compat"
TASK = "What is the weather in Paris? Answer with the city and the temperature."


class Report(BaseModel):
    city: str
    temperature: int


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"{city}: 21 degrees, sunny"


def tool_calls_of(row: dict) -> list[str]:
    """Names of the tools a logged turn called (chat completions shape)."""
    response = json.loads(row["response"] or "{}")
    names = []
    for choice in response.get("choices") or []:
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            names.append(call["function"]["name"])
    return names


def check_rows(
    rows: list[dict],
    rollout_id: str,
    turns: int,
    tool: str = "get_weather",
    exact: bool = True,
    extends: bool = False,
) -> None:
    """The agent's turns are all logged, tagged, token-exact (`exact`; else in the chat
    shape with the API's own bodies under `raw`), and its tool call is there; with
    `extends`, each turn's recorded conversation extends the one before."""
    assert len(rows) == turns, [r["request"][:200] for r in rows]
    for row in rows:
        assert row["rollout_id"] == rollout_id
        assert row["group_id"] == GROUP
        assert row["http_status"] == 200 and row["error"] is None
        assert row["finish_reason"] in ("stop", "tool_calls") and not row["partial"]
        if exact:
            assert row["prompt_token_ids"] and row["completion_token_ids"]
            assert len(row["completion_logprobs"]) == len(row["completion_token_ids"])
        else:  # Messages (no ids from vLLM), Responses here (the scripted upstream gives
            # none; vLLM does: test_real_vllm.py): re-tokenised by the trainer (docs/wire.md)
            assert not row["prompt_token_ids"] and not row["completion_token_ids"]
            request, response = json.loads(row["request"]), json.loads(row["response"])
            assert request["messages"] and request["raw"] and response["raw"]
            assert row["prompt_tokens"] and row["completion_tokens"]
            if row["endpoint"] == "responses" and row["finish_reason"] == "stop":
                assert row["completion_logprobs"]  # asked for by the proxy, and recorded
    assert any(tool in tool_calls_of(row) for row in rows)
    if not extends:
        return
    # Each turn's conversation extends the one before: the whole rollout is recorded.
    conversations = [json.loads(row["request"])["messages"] for row in rows]
    for before, after in zip(conversations, conversations[1:], strict=False):
        assert after[: len(before)] == before
