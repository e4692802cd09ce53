"""Logged conversations rendered with the local model's chat template (--sft nights).

An --sft night imitates what the upstream answered: a hosted model gives text and tool
calls but no token ids, and the ids another server logged belong to its own tokenizer.
So every turn is rendered here from its text, with the local base model's template:

    context     the request's messages (and tools), with the generation prompt
    completion  what the template adds once the reply follows them: the reply's content,
                its tool calls in the template's own format, its end-of-turn token

Each turn's reply is trained in the context it was answered in. A rollout's turns go
through `merge_turns` as logged turns do: where the next turn's context renders
everything before it unchanged (the tool result, the next user message), the turns are
one sequence with several trained spans; where the template renders an earlier reply
otherwise (Qwen3 drops the reasoning of replies before the last user message), the next
turn starts a sequence of its own, so every reply is trained once, in the form the
model saw it. Only replies the upstream wrote are trained, never assistant messages a
client put in its request (its few-shot examples, a history it rewrote).

What cannot be rendered faithfully is skipped with its reason (`Loaded.skipped`) and
stays in the store: a later night, with a template that renders it, can still train it.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pyarrow as pa

from .data import DataError, Turn, merge_turns
from .images import Rendering
from .logged_turns import Loaded, chat_ids

# The endpoints whose rows hold a conversation in the chat shape (the proxy normalises
# Responses and Messages requests: proxy/capture/conversation.py).
CONVERSATION_ENDPOINTS = ("chat.completions", "responses", "messages")
# An assistant message with these keys and no content is reasoning alone (a Responses
# reasoning item), or nothing.
BARE = {"role", "content", "reasoning_content"}


def chat_messages(messages, vision=None) -> list[dict]:
    """`messages` as chat templates take them (transformers' conventions): content text,
    "" where a reply had none; tool call arguments as objects, which a template writes in
    its own format; reasoning under `reasoning_content`, merged into the reply it
    preceded. With `vision` (a vision-language model's reader, whose processor renders
    them), content may be text and image parts (as `vision.image_of` tells them), kept
    as they are. Anything else a template cannot render faithfully is a DataError."""
    if not isinstance(messages, list) or not messages:
        raise DataError("a record without messages")
    out: list[dict] = []
    reasoning = None  # a Responses reasoning item: its own message, before the reply
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError("a message that is not an object with a role")
        if "item" in message:
            raise DataError("a built-in tool's call (no chat template renders it)")
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" for p in content
        ):
            content = "".join(str(p.get("text") or "") for p in content)
        if (
            vision is not None
            and isinstance(content, list)
            and all(
                isinstance(p, dict) and (p.get("type") == "text" or vision.image_of(p))
                for p in content
            )
        ):
            pass  # text and pictures, for the processor's template
        elif content is not None and not isinstance(content, str):
            raise DataError("a message's content is not text (an image, or not a string)")
        message["content"] = content if isinstance(content, list) else content or ""
        if message.get("reasoning") and not message.get("reasoning_content"):
            message["reasoning_content"] = message.pop("reasoning")
        if message["role"] == "assistant" and not message["content"] and set(message) <= BARE:
            reasoning = message.get("reasoning_content") or reasoning
            continue  # reasoning alone: it belongs to the next reply
        if message["role"] == "assistant" and reasoning and not message.get("reasoning_content"):
            message["reasoning_content"] = reasoning
        reasoning = None
        if message.get("tool_calls"):
            message["tool_calls"] = [_call(c) for c in message["tool_calls"]]
        out.append(message)
    if reasoning is not None:  # the reply itself was only reasoning
        out.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
    return out


def _call(call) -> dict:
    """A tool call with its arguments as an object (JSON text parsed), as templates expect."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise DataError("a tool call without a function name")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise DataError("a tool call whose arguments are not JSON") from None
    if not isinstance(arguments, dict):
        raise DataError("a tool call whose arguments are not an object")
    return {**call, "function": {**function, "arguments": arguments}}


def render_turn(tokenizer, request: dict, reply: dict, vision=None) -> Turn:
    """One turn: the request's conversation as context, the reply as the completion.
    `vision`: a vision-language model's reader (trainer/choose/images.py), whose
    processor renders a context that shows images (`vision.shows_images`), pictures
    and all."""
    context = chat_messages(request.get("messages"), vision)
    answer = (chat_messages([reply]) or [{}])[-1]
    if not (answer.get("content") or answer.get("tool_calls") or answer.get("reasoning_content")):
        raise DataError("an empty reply")
    tools = request.get("tools") or None
    images = None
    if vision is not None and vision.shows_images(context):
        prompt, images = vision.rendered(Rendering(context, tools, add_generation_prompt=True))
        whole, _ = vision.rendered(Rendering([*context, answer], tools, False))
    else:  # a DataError where the template cannot render it
        prompt = chat_ids(tokenizer, context, tools, add_generation_prompt=True)
        whole = chat_ids(tokenizer, [*context, answer], tools, add_generation_prompt=False)
    if whole[: len(prompt)] != prompt:
        raise DataError(
            "the local chat template renders the context differently once the reply follows"
        )
    completion = whole[len(prompt) :]
    if answer.get("tool_calls") and not _renders_calls(tokenizer, completion, answer):
        # A template without tool support (SmolLM2's) writes the reply's content alone:
        # imitated, it would teach the model to answer a call with nothing.
        raise DataError("the local chat template does not render tool calls")
    return Turn(prompt, _through_end_of_turn(tokenizer, completion), None, vision=images)


def _renders_calls(tokenizer, completion: list[int], answer: dict) -> bool:
    """Whether the rendered reply names each function it called."""
    text = tokenizer.decode(completion)
    names = [(c.get("function") or {}).get("name") for c in answer["tool_calls"]]
    return all(isinstance(n, str) and n in text for n in names)


def _through_end_of_turn(tokenizer, completion: list[int]) -> list[int]:
    """The completion up to its end-of-turn token: what a template writes after it (the
    newline after Qwen's <|im_end|>) is the next turn's context, never generated."""
    special = set(tokenizer.all_special_ids)
    last = max((i for i, t in enumerate(completion) if t in special), default=None)
    if last is None or tokenizer.decode(completion[last + 1 :]).strip():
        return completion
    return completion[: last + 1]


def load_conversations(con, rollouts: list[str], tokenizer, vision=None) -> Loaded:
    """Samples of `rollouts` (each its turns in order), rendered with `tokenizer`'s chat
    template (a turn that shows images, with `vision`'s processor); every turn's reply
    trained, the rest context. Sampled at no temperature: the loss is the model's own
    distribution's cross-entropy."""
    out = Loaded()
    if not rollouts:
        return out
    con.register("_sft_rollouts", pa.table({"rollout_id": pa.array(rollouts, pa.string())}))
    table = con.sql(
        """
        SELECT group_id, rollout_id, error, endpoint, request, response FROM completions
        WHERE rollout_id IN (SELECT rollout_id FROM _sft_rollouts)
        ORDER BY group_id, rollout_id, started_at, turn_index
        """
    ).to_arrow_table()
    turns: dict[tuple[str, str], list[Turn]] = defaultdict(list)
    for group_id, rollout_id, error, endpoint, request, response in zip(
        *(column.to_pylist() for column in table.columns), strict=True
    ):
        try:
            turn = _turn(tokenizer, error, endpoint, request, response, vision)
        except DataError as e:
            out.skipped[str(e)] += 1
            continue
        turns[(group_id, rollout_id)].append(turn)
        out.retokenised += 1
    for (group_id, rollout_id), rollout_turns in turns.items():
        out.samples += merge_turns(rollout_id, group_id, rollout_turns)
    return out


def _turn(tokenizer, error, endpoint, request, response, vision) -> Turn:
    if error is not None:
        raise DataError("the turn failed or was cut off")
    if endpoint not in CONVERSATION_ENDPOINTS:
        raise DataError("a text completion: no conversation to render")
    if not request or not response:
        raise DataError("not logged (X-Rollout-Log: off)")
    request, response = json.loads(request), json.loads(response)
    if not isinstance(request, dict) or not isinstance(response, dict):
        raise DataError("a record without messages")
    choice = (response.get("choices") or [{}])[0]
    reply = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(reply, dict):
        raise DataError("a record without a reply message")
    if choice.get("finish_reason") == "length":
        # Imitated, it would teach the model to end its turn where a cap cut the text.
        raise DataError("the reply was cut off at its token limit (finish_reason length)")
    return render_turn(tokenizer, request, {"role": "assistant", **reply}, vision)
