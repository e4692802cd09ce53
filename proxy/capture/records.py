"""Rows for the storage tables, built from what a request produced.

Rows are plain dicts in the column names of `overnight.storage.schema`; nested JSON
(the request, the response) stays a dict here and is encoded once, by the log
writer's thread, off the event loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from overnight.errors import OvernightError
from overnight.storage import SCHEMA_VERSION, new_id, now_us
from overnight.storage.read.sent_by import CLIENT

from .attribution import Attribution, validate_id
from .captures import Capture, TurnCounter
from .chat import ChoiceState


def completion_rows(
    capture: Capture,
    who: Attribution,
    *,
    started: int,
    turn_counter: TurnCounter,
    logged: bool,
    proxy_id: str,
    ended: int | None = None,
) -> list[dict]:
    """One row per choice; a request that produced no choice still leaves one row.
    `ended`: when the answer ended (now_us), if it was not just now.

    Long because a completion row is: one literal, column by column in schema order."""
    acc = capture.acc
    indices = sorted(acc.choices) or [0]
    ended = now_us() if ended is None else ended
    usage = acc.usage or {}
    error = capture.error
    if error is None and acc.error is not None:
        error = f"upstream error in stream: {acc.error}"
    n = len(indices)
    attribution = who.source if who.source != "none" or n == 1 else "choices"
    position = conversation_turns(capture.request_body)
    rows = []
    for (group_id, rollout_id), index in zip(who.rows(capture.request_id, n), indices, strict=True):
        state = acc.choices.get(index)
        finish_reason = state.finish_reason if state else None
        rows.append(
            {
                "record_id": new_id(),
                "request_id": capture.request_id,
                "schema_version": SCHEMA_VERSION,
                "started_at": started,
                "ended_at": ended,
                "group_id": group_id,
                "rollout_id": rollout_id,
                "attribution": attribution,
                # The conversation's own count, which every proxy reads the same; this
                # process's count only where it is larger (an agent that starts a fresh
                # conversation each turn): that one is per proxy (docs/architecture.md).
                "turn_index": max(position, turn_counter.next(rollout_id)),
                "choice_index": index,
                "endpoint": capture.endpoint,
                "model_requested": capture.request_body.get("model"),
                "model_served": capture.route.served,
                "adapter_version": capture.route.version,
                # Stored once per HTTP request: on the first choice's row only (the
                # `completions` view gives it back to the others), not n times.
                "request": capture.request_body if logged and not rows else None,
                "request_shared": True if logged and n > 1 else None,
                "response": (acc.response(index) if state else _error_body(capture))
                if logged
                else None,
                "prompt_token_ids": acc.prompt_ids(index) if logged else None,
                "completion_token_ids": state.token_ids if state and logged else None,
                "completion_logprobs": state.logprobs if state and logged else None,
                "finish_reason": finish_reason,
                "http_status": capture.status,
                "error": error,
                "partial": state is not None and finish_reason is None,
                "latency_ms": capture.latency_ms,
                "ttft_ms": capture.ttft_ms,
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": _completion_tokens(usage, state, n),
                "stream": capture.stream,
                "logged": logged,
                "proxy_id": proxy_id,
            }
        )
        note = _ids_note(acc, state) if logged else None
        if note is not None:
            rows[-1]["notes"] = {"completion_token_ids": note}
    return rows


def record_rows(
    capture: Capture,
    who: Attribution,
    turn_counter: TurnCounter,
    proxy_id: str,
    facts: RecordFacts,
) -> list[dict]:
    """A completion's rows as they are stored (before `--redact`): `completion_rows`
    with the scoped key's note and a hosted upstream's, wherever they are built (in the
    serving process, or in its recorder process: recorder.py)."""
    rows = completion_rows(
        capture,
        who,
        started=facts.started,
        turn_counter=turn_counter,
        logged=facts.logged,
        proxy_id=proxy_id,
        ended=facts.ended,
    )
    for row in rows:
        row["sent_by"] = facts.sent_by
    add_key_note(rows, facts.key_note)
    if facts.hosted is not None:
        add_upstream_note(rows, facts.hosted, capture.acc.meta.get("model"))
    return rows


@dataclass(slots=True)
class RecordFacts:
    """What a completion's record needs beside its Capture and attribution, known in the
    serving process when the answer was sent."""

    started: int  # now_us() when the request arrived
    ended: int  # now_us() when its answer had been sent
    logged: bool  # false: X-Rollout-Log: off, the row keeps no contents
    key_note: dict | None = None  # a scoped key's name and refusals (routes/keys.py)
    hosted: str | None = None  # a hosted upstream's label (routes/hosted.py)
    sent_by: str = CLIENT  # an agent, or what of overnight's own (routes/auth.py SENT_BY)


def add_key_note(rows: list[dict], note: dict | None) -> None:
    """A scoped key's note (routes/keys.py `record_note`) in the rows' `notes`: its name on
    every choice's row, its refusals on the first only, so a sum over rows counts each once."""
    if note is None:
        return
    for i, row in enumerate(rows):
        # Every choice's row names the key; the refusals (and fetched images) the first.
        extra = note if i == 0 else ({"key": note["key"]} if "key" in note else {})
        row["notes"] = {**(row.get("notes") or {}), **extra}


def add_upstream_note(rows: list[dict], upstream: str, answered: object) -> None:
    """A hosted upstream's records (routes/hosted.py): each names that upstream in its
    `notes` (kind and host, never a key or a query), has no token ids and no logprobs
    (null: none were given; logprobs a client asked for are the hosted model's, not the
    policy's), and is served by the model the answer names (`gpt-4o-2024-08-06` for
    `gpt-4o`) where it names one."""
    for row in rows:
        row["notes"] = {**(row.get("notes") or {}), "upstream": upstream}
        row["prompt_token_ids"] = row["completion_token_ids"] = None
        row["completion_logprobs"] = None
        if isinstance(answered, str) and answered:
            row["model_served"] = answered


def _ids_note(acc, state: ChoiceState | None) -> str | None:
    """Why a choice's record is not token-exact, when the capture knows (else None)."""
    note = getattr(acc, "note", None)
    if note is not None or state is None or not state.token_ids:
        return note
    if len(state.logprobs) != len(state.token_ids):
        return (
            f"{len(state.token_ids)} token ids but {len(state.logprobs)} logprobs: vLLM "
            "gave no logprob for some tokens (in a Responses stream, those without text "
            "of their own: a stop token, part of a character)"
        )
    return None


def conversation_turns(request: dict) -> int:
    """The model's turns already in a chat-shaped request: runs of assistant messages
    (a Responses reply becomes several: reasoning, text, calls). Every proxy reads the
    same number from the same request, so it numbers a turn the same whichever of
    several proxies (or a restarted one) sees it; text completions have none: 0."""
    messages = request.get("messages")
    if not isinstance(messages, list):
        return 0
    turns, previous = 0, None
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        turns += role == "assistant" and previous != "assistant"
        previous = role
    return turns


def _completion_tokens(usage: dict, state: ChoiceState | None, n: int) -> int | None:
    # usage counts all n choices together; per choice the token ids are exact.
    if state is not None and state.token_ids:
        return len(state.token_ids)
    return usage.get("completion_tokens") if n == 1 else None


def _error_body(capture: Capture) -> dict | None:
    return {"error_body": capture.error_body} if capture.error_body else None


class BadReward(OvernightError):
    status = 400
    code = "invalid_reward"


def parse_reward(body: dict) -> tuple[float, dict]:
    unknown = set(body) - {"reward", "metrics"}
    if unknown:
        raise BadReward(
            f"unknown field(s) {sorted(unknown)}; expected 'reward' and optional 'metrics'"
        )
    reward = body.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise BadReward(f"'reward' must be a finite number, got {reward!r:.100}")
    metrics = body.get("metrics", {})
    if not isinstance(metrics, dict):
        raise BadReward("'metrics' must be an object of names to values")
    return float(reward), metrics


def reward_row(rollout_id: str, reward: float, metrics: dict, proxy_id: str) -> dict:
    return {
        "reward_id": new_id(),
        "schema_version": SCHEMA_VERSION,
        "rollout_id": validate_id(rollout_id, "rollout id"),
        "reward": reward,
        "metrics": metrics,
        "source": "agent",
        "created_at": now_us(),
        "proxy_id": proxy_id,
    }


def finish_row(rollout_id: str, proxy_id: str) -> dict:
    return {
        "rollout_id": validate_id(rollout_id, "rollout id"),
        "schema_version": SCHEMA_VERSION,
        "finished_at": now_us(),
        "proxy_id": proxy_id,
    }
