"""What happens next says how a turn went: signals read from the traffic alone.

No reward code, no posted reward, no judge: for each logged assistant turn, the next
exchange of the same conversation is its verdict, and the proxy has already logged it.
A conversation is linked by its messages, never by ids (most production traffic has
none): a later request whose messages begin with this turn's messages and its reply
continues it; one with the very same messages asks again (a regenerate); one whose
messages differ only in the last user message edits the question.

What the next exchange says, each a `Signal` with a value (-1 bad .. +1 good), a
confidence, the rule that said so and the text it read:

- the next user message, read by rules where rules are reliable, and by a complaint
  lexicon and vader where they are not (reading.py): an acceptance ("thanks, that
  works"), a correction or complaint ("no, I asked for ...", "thanks, but it still
  crashes"), a re-ask (much the same words as the question it answered), or else a new
  request (moved on: recorded with value 0, for a message nobody recognised says nothing
  either way);
- a regenerate or an edit of the last message;
- after a tool call: a tool result that reads as an error, or the same tool called
  again with other arguments;
- the turn itself: tool arguments or a JSON answer (`response_format`) that do not
  parse, a reply cut at `length`;
- nothing next after the conversation went quiet (ended): recorded, with value 0, for
  it says nothing either way (satisfied, or gave up).

Pure: turns in, signals out; reading the store and writing the `signals` table is
judge/implicit.py's. How each rule fails (sarcasm, a satisfied user who leaves, a
re-ask for a new reason) is in docs/signals.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from .reading import read
from .trajectories import content_text, message_key

# Evidence is cut to this many characters: enough to see why, not a copy of the traffic.
EVIDENCE_CHARS = 200

# The kinds, and the value each says of the turn it follows.
ACCEPTED = "accepted"
CORRECTED = "corrected"
RE_ASKED = "re_asked"
MOVED_ON = "moved_on"
REGENERATED = "regenerated"
EDITED = "edited"
TOOL_ERROR = "tool_error"
TOOL_RETRY = "tool_retry"
MALFORMED = "malformed"
TRUNCATED = "truncated"
ENDED = "ended"
KINDS = (
    ACCEPTED,
    CORRECTED,
    RE_ASKED,
    MOVED_ON,
    REGENERATED,
    EDITED,
    TOOL_ERROR,
    TOOL_RETRY,
    MALFORMED,
    TRUNCATED,
    ENDED,
)

# A tool result that reports a failure rather than a result.
_TOOL_ERROR = re.compile(
    r"^\W*(error|exception|traceback|failed|failure|invalid|not found|unknown (tool|function)|"
    r"permission denied|timed? ?out)\b|\"error\"\s*:",
    re.IGNORECASE,
)
# Words that carry no question of their own, left out of the re-ask comparison.
_STOP_WORDS = (
    "a an the is are was were be to of in on for and or but it this that what which who "
    "how do does did can could would should i you me my your please again just so"
)
_STOP = frozenset(_STOP_WORDS.split(" "))
# A regenerate or an edit comes soon after the answer it rejects; the same first message
# an hour later is as likely another user with the same question (traffic without ids).
AGAIN_WITHIN_US = 5 * 60 * 1_000_000
RE_ASK_SIMILARITY = 0.6
# An edit keeps much of the message it replaces; a new first message is a new question.
EDIT_SIMILARITY = 0.3  # Jaccard of content words, measured in tests/test_signals.py


@dataclass(frozen=True)
class Turn:
    """One logged assistant turn, as the rules read it."""

    record_id: str
    request_id: str
    rollout_id: str
    attributed: bool  # the agent named its rollout (headers, URL, metadata)
    started_at: int  # microseconds
    messages: list[dict]  # the request's messages, in the chat shape
    reply: dict  # the assistant message
    finish_reason: str | None = None
    response_format: dict | None = None
    group_id: str | None = None  # the rollout group it was logged under


@dataclass(frozen=True)
class Signal:
    record_id: str  # the turn it is about
    kind: str
    value: float  # -1 (bad) .. +1 (good); 0 says nothing either way
    confidence: float  # 0 .. 1
    rule: str  # which rule said so
    evidence: str = ""  # the text it read, cut
    evidence_record: str | None = None  # the record whose request carried it
    extra: dict = field(default_factory=dict)
    source: str = "rules"  # or "classifier": a model's reading of a message (reactions.py)

    @property
    def signal_id(self) -> str:
        """The same signal found again is the same row (a night re-reads recent turns)."""
        key = f"{self.record_id}\x1f{self.kind}\x1f{self.rule}\x1f{self.evidence_record}"
        return hashlib.sha256(key.encode()).hexdigest()[:24]


def read_signals(turns: Iterable[Turn], now_us: int, quiet_us: int) -> list[Signal]:
    """Every signal the traffic gives about each of `turns`. A turn with nothing next is
    `ended` once the conversation has been quiet for `quiet_us` (until then the next
    message may still come)."""
    turns = sorted(turns, key=lambda t: (t.started_at, t.record_id))
    continuing = _continuations(turns)
    by_messages: dict[str, list[Turn]] = {}
    by_question: dict[str, list[Turn]] = {}
    for t in turns:
        by_messages.setdefault(_key(t.messages), []).append(t)
        if t.messages and t.messages[-1].get("role") == "user":
            by_question.setdefault(_key(t.messages[:-1]), []).append(t)
    out: list[Signal] = []
    for t in turns:
        out += _own(t)
        nxt = next(
            (u for u in continuing.get(t.record_id, ()) if u.started_at >= t.started_at), None
        )
        if nxt is not None:
            out += _next_exchange(t, nxt)
        again = _asked_again(t, by_messages, by_question)
        out += again
        if nxt is None and not again and now_us - t.started_at >= quiet_us:
            out.append(Signal(t.record_id, ENDED, 0.0, 0.1, "nothing followed"))
    return out


# -- linking the conversation -----------------------------------------------------------


def _key(messages: list[dict]) -> str:
    """A conversation's identity: its messages as the judge links turns (`message_key`:
    role, text, tool calls; not the fields a client drops or adds sending a reply back)."""
    return hashlib.sha256(json.dumps([message_key(m) for m in messages]).encode()).hexdigest()


def _calls(message: dict) -> list[tuple[str | None, str | None, object]]:
    """A message's tool calls as (id, name, arguments), whatever odd shapes they came in."""
    out = []
    for c in message.get("tool_calls") or ():
        if isinstance(c, dict):
            fn = c.get("function") if isinstance(c.get("function"), dict) else {}
            out.append((c.get("id"), fn.get("name"), fn.get("arguments")))
    return out


def _continuations(turns: list[Turn]) -> dict[str, list[Turn]]:
    """Turn record id -> the later turns whose messages begin with its messages and its
    reply, earliest first. Each turn's prefixes ending in an assistant message are
    hashed once; a turn is continued where its conversation plus reply is one of them."""
    prefixes: dict[str, list[Turn]] = {}
    for u in turns:
        for k, message in enumerate(u.messages, start=1):
            if message.get("role") == "assistant":
                prefixes.setdefault(_key(u.messages[:k]), []).append(u)
    out = {}
    for t in turns:
        found = prefixes.get(_key([*t.messages, t.reply]), [])
        if found:
            out[t.record_id] = [u for u in found if u.record_id != t.record_id]
    return out


# -- what the next exchange says ---------------------------------------------------------


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= EVIDENCE_CHARS else text[: EVIDENCE_CHARS - 1] + "…"


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"\w+", text.lower()) if w not in _STOP}


def similarity(a: str, b: str) -> float:
    """Jaccard similarity of two texts' content words (0 when either has none)."""
    wa, wb = _words(a), _words(b)
    return len(wa & wb) / len(wa | wb) if wa and wb else 0.0


def _next_exchange(t: Turn, u: Turn) -> list[Signal]:
    """What `u`, the request that continued `t`'s conversation, says about `t`: the
    results of its tool calls, then the user's next message."""
    new = u.messages[len(t.messages) + 1 :]
    out = _tool_results(t, u, new)
    user = next((m for m in new if m.get("role") == "user"), None)
    if user is not None:
        out.append(_reaction(t, u, content_text(user.get("content"))))
    return out


def _tool_results(t: Turn, u: Turn, new: list[dict]) -> list[Signal]:
    out = []
    calls = _calls(t.reply)
    ids = {call_id for call_id, _, _ in calls}
    for m in new:
        if m.get("role") == "tool" and m.get("tool_call_id") in ids:
            text = content_text(m.get("content"))
            if _TOOL_ERROR.search(text):
                out.append(
                    Signal(
                        t.record_id,
                        TOOL_ERROR,
                        -1.0,
                        0.7,
                        "tool result reads as an error",
                        _cut(text),
                        u.record_id,
                    )
                )
    if calls:
        again = _tool_called_again(t, u)
        if again:
            out.append(again)
    return out


def _reaction(t: Turn, u: Turn, text: str) -> Signal:
    """The user's next message, read by the rules, the cue lexicons and vader combined
    (reading.py; docs/signals.md: how they fail). A complaint or the rules' acceptance
    comes before the re-ask; a weaker approval after it. Nobody sure: `moved_on`, which
    says nothing (value 0)."""
    question = next(
        (content_text(m.get("content")) for m in reversed(t.messages) if m.get("role") == "user"),
        "",
    )
    alike = similarity(text, question) if question else 0.0
    said = read(text)
    if said is not None and (said.value < 0 or said.reader == "rules"):
        kind = CORRECTED if said.value < 0 else ACCEPTED
        return _said(t, u, text, kind, said)
    if alike >= RE_ASK_SIMILARITY:
        rule = "the next message asks the same again"
        extra = {"similarity": round(alike, 3)}
        return Signal(t.record_id, RE_ASKED, -1.0, 0.7, rule, _cut(text), u.record_id, extra)
    if said is not None:
        return _said(t, u, text, ACCEPTED, said)
    rule = "the next message asks something new"
    # Nobody recognised it: it says nothing either way, never approval.
    return Signal(t.record_id, MOVED_ON, 0.0, 0.3, rule, _cut(text), u.record_id)


def _said(t: Turn, u: Turn, text: str, kind: str, said) -> Signal:
    extra = {"reader": said.reader, **said.detail} if said.reader != "rules" else {}
    return Signal(
        t.record_id, kind, said.value, said.confidence, said.rule, _cut(text), u.record_id, extra
    )


def _tool_called_again(t: Turn, u: Turn) -> Signal | None:
    """`u`'s reply calls a tool `t` called, with other arguments: `t`'s call was a miss."""
    before = {name: arguments for _, name, arguments in _calls(t.reply)}
    for _, name, arguments in _calls(u.reply):
        if name in before and arguments != before[name]:
            return Signal(
                t.record_id,
                TOOL_RETRY,
                -0.5,
                0.5,
                "the same tool called again with other arguments",
                _cut(f"{name}({arguments})"),
                u.record_id,
            )
    return None


def _asked_again(t: Turn, by_messages: dict, by_question: dict) -> list[Signal]:
    """A later request of the same client with `t`'s very messages (a regenerate) or with
    its last user message changed (an edit). An agent's rollouts of one group share their
    prompt on purpose, so within a named group only the same rollout counts (a client
    that names each answer's rollout, as a chat app tagging every reply does, regenerates
    in a group of its own). Without ids, an edit needs a history of its own (an answer
    before the edited message): two users' first questions alike are not an edit, and a
    system prompt is every user's."""

    def same_client(u: Turn) -> bool:
        if u.record_id == t.record_id or u.request_id == t.request_id:
            return False  # the n choices of one request are not a regenerate
        if not 0 <= u.started_at - t.started_at <= AGAIN_WITHIN_US:
            return False
        siblings = (t.attributed or u.attributed) and u.group_id == t.group_id
        return u.rollout_id == t.rollout_id if siblings else True

    out = []
    again = [u for u in by_messages.get(_key(t.messages), ()) if same_client(u)]
    if again:
        u = again[0]
        out.append(
            Signal(
                t.record_id,
                REGENERATED,
                -1.0,
                0.6,
                "the same messages were sent again",
                "",
                u.record_id,
            )
        )
        return out
    history = any(m.get("role") == "assistant" for m in t.messages[:-1])
    if t.messages and t.messages[-1].get("role") == "user" and (history or t.attributed):
        question = content_text(t.messages[-1].get("content"))
        for u in by_question.get(_key(t.messages[:-1]), ()):
            edited = content_text(u.messages[-1].get("content"))
            changed = edited.strip() != question.strip()
            # Without a history, only the same rollout is surely the same client.
            own = history or u.rollout_id == t.rollout_id
            if (
                same_client(u)
                and own
                and changed
                and similarity(edited, question) >= EDIT_SIMILARITY
            ):
                out.append(
                    Signal(
                        t.record_id,
                        EDITED,
                        -0.5,
                        0.5,
                        "the last message was edited and sent again",
                        _cut(edited),
                        u.record_id,
                    )
                )
                break
    return out


# -- what the turn itself says ------------------------------------------------------------


def _own(t: Turn) -> list[Signal]:
    out = []
    for _, _, arguments in _calls(t.reply):
        if isinstance(arguments, str) and not _parses(arguments):
            out.append(
                Signal(
                    t.record_id,
                    MALFORMED,
                    -1.0,
                    1.0,
                    "tool arguments are not JSON",
                    _cut(arguments),
                )
            )
            break
    wanted = (t.response_format or {}).get("type")
    content = content_text(t.reply.get("content"))
    asked_json = wanted in ("json_object", "json_schema") and not t.reply.get("tool_calls")
    if asked_json and not _parses(content):
        out.append(
            Signal(
                t.record_id,
                MALFORMED,
                -1.0,
                1.0,
                f"asked for {wanted}, the answer is not JSON",
                _cut(content),
            )
        )
    if t.finish_reason == "length":
        out.append(
            Signal(
                t.record_id,
                TRUNCATED,
                -0.5,
                0.6,
                "the answer stopped at max_tokens",
                _cut(content[-EVIDENCE_CHARS:]),
            )
        )
    return out


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
