"""Siblings: alternatives sampled for a served turn, and the per-turn groups they form.

Production traffic makes one attempt per request, so its groups hold one rollout and
GRPO learns nothing from them. For a served turn, vLLM is asked for K more samples of
exactly its context (the logged prompt token ids), from the adapter that served it,
with its sampling parameters. They are stored as rows of the `siblings` table, never
of `completions`: nothing that reads served traffic sees them. The served choice and
its siblings form the per-turn group `turn:<served record id>`; the served choice is a
member by reference (`turn:<id>:served`), not copied.

Two writers use these functions: the nightly stage (trainer/choose/resample.py) and the
proxy's shadow sampler, which asks right after the served answer. Both build the
request with `completion_request` and the rows with `sibling_rows`. No request field or
header makes the proxy write a sibling row.

Pure Python over plain mappings: the proxy imports this without torch or litellm.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from overnight.storage.ids import new_id
from overnight.storage.read.images import shows_images
from overnight.storage.schema import SCHEMA_VERSION

TABLE = "siblings"
TURN_PREFIX = "turn:"
ORIGINS = ("resample", "shadow")
# Served endpoints whose rows carry the token ids a sibling is sampled from. Responses
# and Messages rows have none (vLLM gives none there): their context is not token-exact.
ENDPOINTS = ("chat.completions", "completions")
# Request fields that shape how a completion is sampled, copied from the served request
# as they are. Not `seed`: K samples with one seed would all be the same. Not `n`.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


class SiblingError(ValueError):
    """A vLLM response that cannot be stored as siblings of the served turn."""


def turn_group_id(served_record_id: str) -> str:
    """The per-turn group of a served row: the same for nightly and shadow siblings."""
    return TURN_PREFIX + served_record_id


def served_member_id(served_record_id: str) -> str:
    """The served choice's id as a member of its per-turn group (rewards join on it)."""
    return turn_group_id(served_record_id) + ":served"


def _request(served: Mapping) -> dict:
    """The served request as a dict: the proxy holds a dict, a reader gets JSON text."""
    request = served.get("request")
    if isinstance(request, str):
        request = json.loads(request)
    return request if isinstance(request, dict) else {}


def resample_unsupported(served: Mapping) -> str | None:
    """Why this served row cannot be resampled token-exactly, or None when it can."""
    if served.get("endpoint") not in ENDPOINTS:
        return f"endpoint {served.get('endpoint')} has no token ids"
    if served.get("error") is not None or served.get("partial"):
        return "the turn failed or was cut off"
    if not served.get("prompt_token_ids") or not served.get("completion_token_ids"):
        return "no token ids logged"
    request = _request(served)
    if not request:
        return "the request was not logged"
    return decoding_unsupported(request)


def decoding_unsupported(request: Mapping) -> str | None:
    """Why the served request's decoding cannot be redone on token ids, or None."""
    # Grammar-constrained decoding: the chat endpoint builds the grammar from the tools
    # or the schema; a token-id completion cannot be given the same mask.
    choice = request.get("tool_choice")
    fmt = (request.get("response_format") or {}).get("type")
    if choice == "required" or isinstance(choice, dict):
        return "tool_choice constrains decoding (not redone on token ids)"
    if fmt in ("json_object", "json_schema") or request.get("structured_outputs"):
        return "structured output constrains decoding (not redone on token ids)"
    if shows_images(request.get("messages")):
        return "the prompt shows images (token ids carry no pixels)"
    return None


def requested_limit(request: Mapping) -> int | None:
    """The served request's own completion length limit, as vLLM reads it (None: unset)."""
    limit = request.get("max_completion_tokens")
    return request.get("max_tokens") if limit is None else limit


def context_lengths(cards: list[Mapping]) -> dict[str, int | None]:
    """Each model vLLM lists (its /v1/models `data`) -> its context length. vLLM 0.32
    gives `max_model_len` on the base model's card only; an adapter runs in its parent's
    context, so it takes the parent's."""
    cards = [card for card in cards if "id" in card]
    lengths = {card["id"]: card.get("max_model_len") for card in cards}
    return {card["id"]: lengths[card["id"]] or lengths.get(card.get("parent")) for card in cards}


def completion_request(
    served: Mapping,
    k: int,
    *,
    max_model_len: int | None = None,
    max_tokens_cap: int | None = None,
) -> dict[str, Any]:
    """The vLLM /v1/completions body that asks for `k` siblings of the served turn.

    The prompt is the served row's token ids, so the context is exactly what the
    served choice was sampled from. vLLM's completions endpoint caps an unset
    `max_tokens` at 16 (the chat endpoint: the rest of the context), so an unset limit
    becomes `max_model_len - len(prompt)` when that is known.
    """
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    request = _request(served)
    prompt = list(served["prompt_token_ids"])
    body: dict[str, Any] = {
        "model": served["model_served"],
        "prompt": prompt,
        "n": k,
        "logprobs": 0,  # the sampled token's (processed) logprob, no alternatives
        "return_token_ids": True,
        "stream": False,
    }
    body.update({f: request[f] for f in SAMPLING_FIELDS if request.get(f) is not None})
    limit = requested_limit(request)
    if limit is None and max_model_len is not None:
        limit = max(max_model_len - len(prompt), 1)
    if max_tokens_cap is not None:
        limit = max_tokens_cap if limit is None else min(limit, max_tokens_cap)
    if limit is not None:
        body["max_tokens"] = int(limit)
    if parses_tool_calls(request):
        # The chat endpoint decodes a reply to tools with its special tokens when the
        # server's parser asks (hermes and most do: a call's markers may be special
        # tokens). Keep them all; the scorer drops what that parser would not have seen.
        body["skip_special_tokens"] = False
    return body


def sibling_rows(
    served: Mapping,
    response: Mapping,
    *,
    origin: str,
    writer_id: str,
    started_at: int,
    ended_at: int,
    sent: Mapping | None = None,
) -> list[dict]:
    """One `siblings` row per choice of a vLLM /v1/completions `response` for `served`.

    `sent` is the body that was posted (stored without its prompt). Raises
    SiblingError when the response is not what was asked for: no token ids or
    logprobs, or a prompt other than the served one (the context would not be exact).
    """
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, got {origin!r}")
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise SiblingError("the response has no choices")
    prompt = list(served["prompt_token_ids"])
    rows = []
    for choice in choices:
        if not isinstance(choice, dict):
            raise SiblingError("a choice that is not an object")
        echoed = choice.get("prompt_token_ids")
        if echoed is not None and list(echoed) != prompt:
            raise SiblingError("vLLM sampled from another prompt than the served one")
        tokens = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if not tokens or not _numbers(logprobs) or len(logprobs) != len(tokens):
            raise SiblingError("a choice without token ids and one logprob per token")
        row = _base_row(served, origin, writer_id, started_at, ended_at, sent)
        text, finish = choice.get("text") or "", choice.get("finish_reason")
        row.update(
            choice_index=choice.get("index", len(rows)),
            response=_response_shape(served, text, finish, sent),
            completion_token_ids=list(tokens),
            completion_logprobs=[float(lp) for lp in logprobs],
            finish_reason=finish,
            completion_tokens=len(tokens),
        )
        rows.append(row)
    return rows


def _numbers(values) -> bool:
    # vLLM writes null for a token whose logprob it did not compute.
    return isinstance(values, list) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in values
    )


def error_row(
    served: Mapping,
    error: str,
    *,
    origin: str,
    writer_id: str,
    started_at: int,
    ended_at: int,
    sent: Mapping | None = None,
) -> dict:
    """A row that records a failed sampling call (no tokens; never a group member), so
    that the turn is not asked again night after night."""
    row = _base_row(served, origin, writer_id, started_at, ended_at, sent)
    row["error"] = error
    return row


def _base_row(
    served: Mapping, origin: str, writer_id: str, started_at: int, ended_at: int, sent
) -> dict:
    record_id = new_id()
    group = turn_group_id(served["record_id"])
    return {
        "record_id": record_id,
        "schema_version": SCHEMA_VERSION,
        "started_at": started_at,
        "ended_at": ended_at,
        "sibling_of": served["record_id"],
        "group_id": group,
        "rollout_id": f"{group}:{record_id}",
        "origin": origin,
        "model_served": served.get("model_served"),
        "request": {k: v for k, v in (sent or {}).items() if k != "prompt"} or None,
        "latency_ms": (ended_at - started_at) / 1000,
        "proxy_id": writer_id,
    }


# vLLM's hermes parser's pattern: a closed call, or one the reply ended inside of.
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_TOOL_CALL_START = "<tool_call>"


def _response_shape(served: Mapping, text: str, finish: str | None, sent: Mapping | None) -> dict:
    """The alternative as the served endpoint would have answered it (what the judge and
    reward functions read), marked as a sibling.

    A chat turn with tools keeps what vLLM sampled under `raw` (the text, decoded with
    the special tokens `sent` kept, and the finish reason): the served turn's calls were
    parsed by the server's `--tool-call-parser`, which this module cannot know, so the
    scorer parses `raw` again with the same parser (judge/tool_calls.py). The message
    stored here is the hermes reading, as a scorer without vLLM sees it."""
    if served.get("endpoint") != "chat.completions":
        choice = {"index": 0, "text": text, "finish_reason": finish}
        return {"object": "overnight.sibling", "choices": [choice]}
    request = _request(served)
    if not parses_tool_calls(request):
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": finish}
        return {"object": "overnight.sibling", "choices": [choice]}
    message, parsed_finish = assistant_message(text, finish, hermes_tool_calls(text))
    skipped = (sent or {}).get("skip_special_tokens", True)  # vLLM's default: skip
    raw = {"text": text, "finish_reason": finish, "skip_special_tokens": skipped}
    choice = {"index": 0, "message": message, "finish_reason": parsed_finish, "raw": raw}
    return {"object": "overnight.sibling", "choices": [choice]}


def parses_tool_calls(request: Mapping | None) -> bool:
    """Whether vLLM's chat endpoint runs its tool parser on a reply to `request`: it
    offers tools and does not forbid calling them (`required` and named choices are
    never resampled: see `decoding_unsupported`)."""
    return bool((request or {}).get("tools")) and (request or {}).get("tool_choice") != "none"


def assistant_message(
    text: str, finish: str | None, parsed: tuple[str | None, list[dict]] | None
) -> tuple[dict, str | None]:
    """The chat message and finish reason of a reply sampled as `text`, given what a tool
    parser found in it: (content, calls), or None for no call (the text as it is)."""
    if parsed is None:
        return {"role": "assistant", "content": text}, finish
    content, calls = parsed
    if content is not None and not content.strip():
        content = None  # as vLLM's chat endpoint: only whitespace around the calls
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


def tool_call(index: int, name: str, arguments: str) -> dict:
    """A parsed call in the chat shape. The id is the call's place, not vLLM's random
    one, so that two siblings making the same call are the same reply to the judge."""
    return {"id": f"call_{index}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip


def hermes_tool_calls(text: str) -> tuple[str | None, list[dict]] | None:
    """Hermes-style calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) read
    as vLLM 0.32's hermes parser reads them, without vLLM: (the text before the first
    call, the calls), or None when there is no call or one does not parse (then the
    whole reply is text, as vLLM leaves it)."""
    if _TOOL_CALL_START not in text:
        return None
    calls = []
    for i, (closed, open_) in enumerate(_TOOL_CALL.findall(text)):
        try:
            call = json.loads(closed or open_)
        except (ValueError, RecursionError):  # a reply nested past the parser's depth too
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        if "arguments" not in call:  # vLLM reads call["arguments"]: its absence fails
            return None
        calls.append(tool_call(i, call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    return text[: text.find(_TOOL_CALL_START)] or None, calls


# -- reading per-turn groups ---------------------------------------------------------------

# Every member of every per-turn group, in the shape of `completions` rows: the served
# choice (from `completions`, by reference) and each sibling sampled without error,
# both with the served turn's prompt and request. A group whose served row is gone
# (pruned) has no members.
TURN_COMPLETIONS = """
    WITH served AS (
        SELECT c.* FROM completions c
        WHERE c.record_id IN (SELECT sibling_of FROM siblings WHERE error IS NULL)
    )
    SELECT 'turn:' || c.record_id AS group_id, 'turn:' || c.record_id || ':served' AS rollout_id,
           c.record_id, c.record_id AS sibling_of, 'served' AS origin, c.started_at,
           0 AS turn_index, c.choice_index, c.endpoint, c.model_served, c.request, c.response,
           c.prompt_token_ids, c.completion_token_ids, c.completion_logprobs,
           c.finish_reason, c.error, c.logged, c.prompt_tokens, c.completion_tokens
    FROM served c
    UNION ALL
    SELECT s.group_id, s.rollout_id, s.record_id, s.sibling_of, s.origin, s.started_at,
           0 AS turn_index, s.choice_index, c.endpoint, s.model_served, c.request, s.response,
           c.prompt_token_ids, s.completion_token_ids, s.completion_logprobs,
           s.finish_reason, s.error, c.logged, c.prompt_tokens, s.completion_tokens
    FROM siblings s JOIN served c ON c.record_id = s.sibling_of
    WHERE s.error IS NULL
"""

# Every served turn alone, as the served member of its per-turn group (siblings or none):
# what a night trains when a turn has a reward of its own and nothing to compare it with
# (trainer/choose/lone_turns.py).
SERVED_TURNS = """
    SELECT 'turn:' || c.record_id AS group_id, 'turn:' || c.record_id || ':served' AS rollout_id,
           c.record_id, c.started_at, 0 AS turn_index, c.model_served, c.request, c.response,
           c.endpoint, c.prompt_token_ids, c.completion_token_ids, c.completion_logprobs,
           c.error, c.prompt_tokens, c.completion_tokens, c.notes
    FROM completions c
"""

TURN_GROUPS = """
    SELECT t.group_id, any_value(t.sibling_of) AS sibling_of,
           any_value(c.group_id) AS served_group_id,
           any_value(c.rollout_id) AS served_rollout_id,
           count(*) AS members, min(c.started_at) AS started_at
    FROM turn_completions t JOIN completions c ON c.record_id = t.sibling_of
    GROUP BY t.group_id
"""


def add_turn_views(con) -> None:
    """Views `turn_completions`, `turn_groups` and `served_turns` on a connection from
    `open_db`."""
    con.execute(f"CREATE OR REPLACE VIEW turn_completions AS {TURN_COMPLETIONS}")
    con.execute(f"CREATE OR REPLACE VIEW served_turns AS {SERVED_TURNS}")
    con.execute(f"CREATE OR REPLACE VIEW turn_groups AS {TURN_GROUPS}")
