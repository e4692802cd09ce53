"""Reading logged records for training: the turns of each rollout, in order."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import pyarrow as pa

from .data import DataError, Sample, Turn, merge_turns
from .images import Rendering
from .sampling import NEUTRAL, SamplingParams, from_request, unreproduced


@dataclass
class Loaded:
    samples: list[Sample] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # reason -> turns
    retokenised: int = 0  # turns rebuilt from text (less exact)
    # Re-tokenised length minus the upstream's own count, where it reported usage.
    token_count_gaps: list[int] = field(default_factory=list)
    # Logit processing vLLM applied that the trainer does not redo -> turns (sampling.py).
    unreproduced: dict[str, int] = field(default_factory=lambda: defaultdict(int))


# Where groups are read from: served traffic, the per-turn groups of served turns and
# their siblings, or served turns alone (`storage.siblings.add_turn_views`), whose rows
# have the same columns.
VIEWS = ("completions", "turn_completions", "served_turns")


# A turn a hosted model answered (its record's notes name the upstream: a hosted proxy,
# or a handover's hosted side) is a reference, never a sample of the policy's.
HOSTED_SKIP = "served by a hosted model (a reference, not sampled from the policy)"
# A turn `overnight import` brought in from another tool's logs (its notes' upstream is
# `imported:<format>`, overnight/imports/calls.py): no token ids, never the policy's sample.
IMPORTED_SKIP = "imported: no token ids (off-policy)"


def load_samples(
    con,
    group_ids: list[str],
    tokenizer=None,
    sampling_defaults: dict | None = None,
    view: str = "completions",
    vision=None,
) -> Loaded:
    """Samples of every rollout in `group_ids`, built from the logged token ids.

    `view` is one of VIEWS: a per-turn group's members are each one turn, the served
    turn's prompt and one alternative completion, with the logprobs it was sampled with.

    Each turn keeps how it was sampled: the request's temperature, top-k, top-p and
    min-p, else `sampling_defaults` (the server's: `sampling.server_defaults`).

    `vision` (a vision-language model's: trainer/choose/images.py) gives each turn the
    images its prompt showed, rebuilt through the processor and checked against the
    logged ids; a turn it cannot rebuild is skipped with its reason.

    Turns logged without token ids (an upstream that is not vLLM) are re-tokenised
    from their text with `tokenizer`'s chat template when one is given. That path is
    less exact: the template may not reproduce what the server tokenised, and the
    sampling logprobs are unknown (training then treats the starting policy as the
    behaviour policy). How many turns took it, and how far their token counts are
    from the upstream's own usage counts, is reported.
    """
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    out = Loaded()
    if not group_ids:
        return out
    con.register("_train_groups", pa.table({"group_id": group_ids}))
    # Per-turn groups' members are vLLM's (siblings ask it by token ids): no notes there.
    upstream = "NULL" if view == "turn_completions" else "json_extract_string(notes, '$.upstream')"
    # As Arrow columns, not DuckDB's row tuples: token id lists convert many times faster.
    table = con.sql(
        f"""
        SELECT group_id, rollout_id, model_served, prompt_token_ids, completion_token_ids,
               completion_logprobs, error, request, response, prompt_tokens, completion_tokens,
               endpoint, {upstream} AS upstream
        FROM {view} WHERE group_id IN (SELECT group_id FROM _train_groups)
        ORDER BY group_id, rollout_id, started_at, turn_index
        """
    ).to_arrow_table()
    rows = zip(*(column.to_pylist() for column in table.columns), strict=True)
    turns: dict[tuple[str, str], list[Turn]] = defaultdict(list)
    defaults = sampling_defaults or {}
    for group_id, rollout_id, served_by, prompt, completion, logprobs, error, *text in rows:
        *text, upstream = text
        if error is not None:
            out.skipped["the turn failed or was cut off"] += 1
        elif upstream is not None:  # not sampled from the policy: off-policy (docs/grpo.md)
            out.skipped[IMPORTED_SKIP if upstream.startswith("imported:") else HOSTED_SKIP] += 1
        elif not prompt or not completion:
            try:
                turn = _retokenise(tokenizer, *text, out, vision) if tokenizer is not None else None
            except DataError as e:
                out.skipped[str(e)] += 1
                continue
            if turn is None:
                out.skipped["no token ids logged"] += 1
            else:  # the starting policy is its behaviour: processed as it is trained
                sampling = _sampling(text[0], defaults, None)
                turns[(group_id, rollout_id)].append(
                    replace(turn, sampling=sampling, served_by=served_by)
                )
        else:
            try:
                sampling = _sampling(text[0], defaults, out)
                images = vision.turn(text[0], prompt) if vision is not None else None
                turns[(group_id, rollout_id)].append(
                    Turn(prompt, completion, logprobs or [], sampling, served_by, images)
                )
            except DataError as e:
                out.skipped[str(e)] += 1
    for (group_id, rollout_id), rollout_turns in turns.items():
        out.samples += merge_turns(rollout_id, group_id, rollout_turns)
    return out


def _sampling(request: str | None, defaults: dict, out: Loaded | None) -> SamplingParams:
    """How a turn was sampled, from its logged request body (not logged: the defaults);
    what vLLM did that the trainer cannot redo is counted in `out`."""
    import json

    body = json.loads(request) if request else {}
    if not isinstance(body, dict):
        return NEUTRAL
    for name in unreproduced(body, defaults) if out is not None else ():
        out.unreproduced[name] += 1
    return from_request(body, defaults)


def chat_ids(tokenizer, messages: list[dict], tools, add_generation_prompt: bool) -> list[int]:
    """The token ids the chat template renders `messages` (and `tools`) to (render.py
    renders whole turns, tool calls included, for --sft nights); a DataError where the
    template cannot render them."""
    try:
        encoded = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
            tokenize=True,
        )  # fmt: skip
    except Exception as e:  # jinja2's errors, a template's raise_exception, a bad value
        raise DataError(
            f"the local chat template cannot render it ({type(e).__name__}: {str(e)[:120]})"
        ) from None
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _retokenise(
    tokenizer,
    request,
    response,
    prompt_tokens,
    completion_tokens,
    endpoint,
    out: Loaded,
    vision=None,
):
    """A Turn rebuilt from the logged text, or None when that cannot be done faithfully.
    A prompt that shows images (`vision.shows_images`: grpo never reads the store) is
    built by the model's processor (`vision`), as vLLM built it; a DataError says why
    one cannot be."""
    import json

    # Responses and Messages rows hold their conversation in the chat shape too (the
    # proxy normalises them; vLLM gives no token ids there), so they re-tokenise alike.
    if endpoint not in ("chat.completions", "responses", "messages"):
        return None  # a text completion: no conversation to render
    if not request or not response:
        return None  # not logged (X-Rollout-Log: off)
    try:
        request, response = json.loads(request), json.loads(response)
    except ValueError:
        raise DataError("a record whose request or response is not JSON") from None
    messages = request.get("messages") if isinstance(request, dict) else None
    choices = response.get("choices") if isinstance(response, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(messages, list) or not messages or not isinstance(message, dict):
        raise DataError("a record without its messages or its reply")
    if message.get("tool_calls") or not message.get("content"):
        return None  # the template's rendering of a call is not the model's own tokens
    if not isinstance(message["content"], str):
        raise DataError("a reply whose content is not text")
    tools = request.get("tools")
    if vision is not None and vision.shows_images(messages):
        prompt, images = vision.rendered(Rendering(messages, tools))
        if prompt_tokens is not None and len(prompt) != prompt_tokens:
            # The proof the logged ids give elsewhere: the pictures were tiled and placed
            # as vLLM did (another processor setting would train on other pixels).
            raise DataError(
                f"the processor builds {len(prompt)} prompt tokens for the turn's images and "
                f"text where vLLM counted {prompt_tokens} (another processor or template?)"
            )
    else:
        prompt, images = chat_ids(tokenizer, messages, tools, True), None
    completion = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
    if choice.get("finish_reason") == "stop" and tokenizer.eos_token_id is not None:
        completion = completion + [tokenizer.eos_token_id]
    if prompt_tokens is not None and completion_tokens is not None:
        out.token_count_gaps.append(
            len(prompt) + len(completion) - prompt_tokens - completion_tokens
        )
    out.retokenised += 1
    return Turn(prompt, completion, None, vision=images)
