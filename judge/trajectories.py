"""Logged rollouts as the judge sees them: every turn, grouped, trimmed.

An agent usually resends its history on every turn, so each turn's conversation (its
request's messages plus the reply) extends the one before, and the last turn holds the
whole trajectory. Not always: an agent that compacts or summarises its history, asks a
model for a summary, or calls a sub-agent inside the same rollout has turns that do
not extend each other. A rollout is therefore rendered from all of its turns, in order:
a turn that extends an earlier one adds only what is new; a turn that extends none
starts a new context, marked as such, without the leading messages it shares with an
earlier turn. For the usual agent that is exactly its last turn's conversation.

The rollouts of a group usually share their first messages (system prompt, task);
those are shown to the judge once as context, and each trajectory only from where it
diverges.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# A message's content as text, each image named by its label: the judge's, the gate's
# examples' (storage/read/images.py, where the trainer can read it too).
from overnight.storage.read.images import content_text, image_label, image_of  # noqa: F401

# Tool outputs longer than this are cut in the middle: a judge needs their start and
# end to follow the story, rarely all of a 50 KB search result.
MAX_TOOL_CHARS = 2000
# The role of the lines the judge reads as "a new context begins here"; no API has it.
MARKER_ROLE = "overnight"


@dataclass(frozen=True)
class Trajectory:
    rollout_id: str
    messages: list[dict]  # every turn, in order, with markers where a new context starts
    tools: list[dict] = field(default_factory=list)
    # The last turn's own conversation, as the agent sent it (what a reward function
    # reads); None: the same as `messages` (one context, no markers).
    conversation: list[dict] | None = None

    @property
    def last_conversation(self) -> list[dict]:
        return self.messages if self.conversation is None else self.conversation


@dataclass(frozen=True)
class Group:
    group_id: str
    trajectories: list[Trajectory]


def turn_messages(request: dict | None, response: dict | None) -> tuple[list[dict], list[dict]]:
    """One turn's conversation (its request's messages and the reply) and its tools."""
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
    return messages, list(request.get("tools") or [])


def trajectory_from_turn(
    rollout_id: str, request: dict | None, response: dict | None
) -> Trajectory:
    """The conversation of a rollout that has one logged turn."""
    return rollout_from_turns(rollout_id, [(request, response)])


def message_key(message: dict) -> str:
    """What makes two messages the same turn of a conversation. A reply as logged and
    the same reply as the agent sends it back differ in fields nobody reads (`refusal:
    null`, `annotations`, `reasoning`), so only role, text, tool calls and tool call id
    count."""
    calls = [
        [
            c.get("id"),
            (c.get("function") or {}).get("name"),
            (c.get("function") or {}).get("arguments"),
        ]
        for c in message.get("tool_calls") or ()
        if isinstance(c, dict)
    ]
    key = [
        message.get("role"),
        content_text(message.get("content")),
        calls,
        message.get("tool_call_id"),
    ]
    return json.dumps(key, ensure_ascii=False)


def rollout_from_turns(rollout_id: str, turns: list[tuple[dict | None, dict | None]]) -> Trajectory:
    """A rollout from all of its turns, in order (see the module's docstring)."""
    heads: list[list[str]] = []  # each context's conversation so far, as message keys
    head_turn: list[int] = []  # the turn that last extended each context (1-based)
    out: list[dict] = []
    tools: dict[str, dict] = {}
    current = -1
    conversation: list[dict] = []
    for n, (request, response) in enumerate(turns, start=1):
        conversation, turn_tools = turn_messages(request, response)
        tools.update((json.dumps(t, sort_keys=True), t) for t in turn_tools)
        keys = [message_key(m) for m in conversation]
        asked = len(keys) - _replies(response)  # the request's part: what may extend a head
        extends = [i for i, h in enumerate(heads) if len(h) <= asked and keys[: len(h)] == h]
        if extends:
            i = max(extends, key=lambda i: len(heads[i]))
            if i != current:
                out.append(marker(f"turn {n} continues the context of turn {head_turn[i]}"))
            out += conversation[len(heads[i]) :]
            heads[i], head_turn[i] = keys, n
        else:
            shared, since = _longest_shared(heads, head_turn, keys)
            if heads:
                out.append(marker(_new_context(n, shared, since)))
            out += conversation[shared:]
            heads.append(keys)
            head_turn.append(n)
            i = len(heads) - 1
        current = i
    single = not any(m.get("role") == MARKER_ROLE for m in out)
    return Trajectory(rollout_id, out, list(tools.values()), None if single else conversation)


def marker(text: str) -> dict:
    return {"role": MARKER_ROLE, "content": text}


def _replies(response: dict | None) -> int:
    return len((response or {}).get("choices") or ())


def _longest_shared(
    heads: list[list[str]], head_turn: list[int], keys: list[str]
) -> tuple[int, int]:
    """(How many leading messages `keys` shares with an earlier context, that context's
    turn); never all of them, so that the turn adds at least its reply."""
    best, since = 0, 0
    for head, turn in zip(heads, head_turn, strict=True):
        n = 0
        while n < min(len(head), len(keys) - 1) and head[n] == keys[n]:
            n += 1
        if n > best:
            best, since = n, turn
    return best, since


def _new_context(n: int, shared: int, since: int) -> str:
    text = f"turn {n} does not continue the conversation above: a new context"
    if shared:
        text += f" that starts with the same {shared} message(s) as turn {since}, then"
    return text


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
