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


def check_rows(rows: list[dict], rollout_id: str, turns: int, tool: str = "get_weather") -> None:
    """The agent's turns are all logged, tagged, token-exact, and its tool call is there."""
    assert len(rows) == turns, [r["request"][:200] for r in rows]
    for row in rows:
        assert row["rollout_id"] == rollout_id
        assert row["group_id"] == GROUP
        assert row["http_status"] == 200 and row["error"] is None
        assert row["prompt_token_ids"] and row["completion_token_ids"]
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"])
    assert any(tool in tool_calls_of(row) for row in rows)
