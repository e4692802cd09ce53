"""Logged rollouts as the judge sees them: whole conversations, grouped, trimmed.

An agent resends its history on every turn, so a rollout's last turn (its request's
messages plus the reply) is the whole trajectory. The rollouts of a group usually
share their first messages (system prompt, task); those are shown to the judge once
as context, and each trajectory only from where it diverges.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# Tool outputs longer than this are cut in the middle: a judge needs their start and
# end to follow the story, rarely all of a 50 KB search result.
MAX_TOOL_CHARS = 2000


@dataclass(frozen=True)
class Trajectory:
    rollout_id: str
    messages: list[dict]
    tools: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class Group:
    group_id: str
    trajectories: list[Trajectory]


def trajectory_from_turn(
    rollout_id: str, request: dict | None, response: dict | None
) -> Trajectory:
    """The whole conversation of a rollout from its last logged turn."""
    request = request or {}
    if "messages" in request:
        messages = list(request["messages"])
    else:  # text completions: the prompt is the user's part
        messages = [{"role": "user", "content": str(request.get("prompt", ""))}]
    for choice in (response or {}).get("choices") or ():
        if "message" in choice:
            messages.append(choice["message"])
        elif "text" in choice:
            messages.append({"role": "assistant", "content": choice["text"]})
    return Trajectory(rollout_id, messages, list(request.get("tools") or []))


def _canonical(message: dict) -> str:
    return json.dumps(message, sort_keys=True, ensure_ascii=False)


def shared_prefix(trajectories: list[Trajectory]) -> int:
    """How many leading messages every trajectory has in common (never the last one)."""
    if not trajectories:
        return 0
    keys = [[_canonical(m) for m in t.messages] for t in trajectories]
    # Keep at least one message of each trajectory outside the shared context.
    limit = min(len(k) for k in keys) - 1
    n = 0
    while n < limit and all(k[n] == keys[0][n] for k in keys):
        n += 1
    return n


def distinct(trajectories: list[Trajectory]) -> tuple[list[Trajectory], dict[str, str]]:
    """Trajectories with duplicates removed, and each rollout's representative."""
    seen: dict[str, Trajectory] = {}
    representative: dict[str, str] = {}
    for t in trajectories:
        key = json.dumps([[_canonical(m) for m in t.messages], t.tools], sort_keys=True)
        first = seen.setdefault(key, t)
        representative[t.rollout_id] = first.rollout_id
    return list(seen.values()), representative


def shorten(text: str, limit: int = MAX_TOOL_CHARS) -> tuple[str, bool]:
    """`text` cut in the middle to about `limit` characters, with a marker."""
    if len(text) <= limit:
        return text, False
    head, tail = limit * 2 // 3, limit // 3
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[-tail:]}", True


def trim_tool_outputs(messages: list[dict], limit: int = MAX_TOOL_CHARS) -> tuple[list[dict], int]:
    """Long tool outputs shortened, except in the last message; returns how many were cut."""
    out, cut = [], 0
    for i, message in enumerate(messages):
        content = message.get("content")
        if message.get("role") == "tool" and isinstance(content, str) and i < len(messages) - 1:
            content, was_cut = shorten(content, limit)
            if was_cut:
                message = {**message, "content": content}
                cut += 1
        out.append(message)
    return out, cut
