"""What the proxy asks vLLM for on chat and text completions, and how it hides it again.

A record needs the token ids vLLM sampled and their logprobs; the client asked for
neither. So the proxy adds `return_token_ids`, `logprobs` and, on streams,
`stream_options.include_usage`, and removes from the answer what they put there: the
client gets what vLLM alone would have sent it. Only where asking leaves the answer so,
which vLLM 0.32 does not always do (read in its serving code, held to it by
tests/test_differential.py):

- `echo` on a text completion: `return_token_ids` blanks the echoed prompt
  (`needs_detokenization = echo and not return_token_ids`), so it is not asked; the
  ids come from the logprobs' tokens instead (`return_tokens_as_token_ids`), which
  start with the prompt's. There `logprobs` is also the prompt logprobs count (they
  appear in the answer: hidden too); it is refused with beam search, and a streamed
  echo with n > 1 fails in vLLM with it (the prompt logprobs come with one choice's
  first output only: IndexError, an in-band 500), so then nothing is asked.
- `logprobs` would let through what vLLM refuses unless the client set it
  (`top_logprobs`, `logprob_token_ids`): not added, vLLM's 400 comes back.
- a field the client set to something other than null or false is the client's; what
  is false is read as vLLM's pydantic reads it (`0`, `"false"`, `"no"`, ... are false,
  `1`, `"true"`, `"yes"` true: `lax_bool`), and a `stream` or `stream_options` it would
  refuse is not the proxy's to judge: then nothing is added (`unreadable`), and vLLM's
  400 comes back.

Where nothing can be asked, the request goes as it came and the record says why it has
no ids (`Additions.note`, into the row's `notes`). A request vLLM refuses with the
additions is sent again as the client sent it (`plain`, routes/relay.py): the client
gets vLLM's verdict on its own request.

A whole answer is vLLM's bytes with the added values nulled in place (`hidden_answer`):
vLLM writes whole answers with Python's json, whose floats orjson would write otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from overnight.proxy.forward.jsonio import whole_dumps

from .chat import CHAT

ECHO_NO_IDS = "no token ids: asking vLLM for them would change its answer to this echo"


@dataclass(slots=True)  # not frozen: one is made per request, and frozen init is slower
class Additions:
    """What the proxy added to the client's request, so it can be hidden again."""

    token_ids: bool = False
    logprobs: bool = False
    usage: bool = False
    # A chat stream for which vLLM sends a chunk per token only because we asked for ids
    # and logprobs: chunks left with `"delta": {}` are ours to drop (vllm 0.32, measured:
    # a `tool_choice: "required"` stream had 18 chunks plain, 41 with the additions).
    empty_chunks: bool = False
    # Under echo, vLLM computes prompt logprobs from our `logprobs` and shows them.
    prompt_logprobs: bool = False
    # A text completion that echoes its prompt: its logprobs start with the prompt's.
    echo: bool = False
    # The ids are read from the logprobs' tokens, "token_id:N" (we asked for that form).
    as_ids: bool = False
    note: str | None = None  # why the record will have no token ids
    # The request as the client sent it, sent instead if vLLM refuses the additions.
    plain: dict | None = field(default=None, compare=False, repr=False)

    @property
    def any(self) -> bool:
        return self.token_ids or self.logprobs or self.usage


# pydantic's lax booleans (what vLLM's request models take for a `bool` field).
_LAX = {
    **dict.fromkeys(("1", "on", "t", "true", "y", "yes"), True),
    **dict.fromkeys(("0", "off", "f", "false", "n", "no"), False),
}
UNREADABLE = "no token ids: the request's stream or stream_options is not of a type vLLM takes"


def lax_bool(value: Any) -> bool | None:
    """A bool field as vLLM's pydantic models read it: None where they refuse it."""
    if value is True or value is False:
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return _LAX.get(value.lower())
    return None


def _unset(value: Any) -> bool:
    """Not asked by the client: absent, null or false as vLLM reads it (any other value
    is the client's, for vLLM to read or refuse)."""
    return value is None or value is False or (value is not True and lax_bool(value) is False)


def unreadable(body: dict) -> bool:
    """Whether `stream` or `stream_options` is of a type vLLM refuses (its 400 is the
    client's answer: nothing is added)."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and lax_bool(stream) is None:
        return True
    return options is not None and not isinstance(options, dict)


def add_training_fields(body: dict, endpoint: str) -> Additions:
    """Ask upstream for token ids, logprobs and usage where that leaves its answer as it
    would be once hidden; mutates `body`."""
    plain = dict(body)
    get = body.get
    if unreadable(body):
        return Additions(note=UNREADABLE, plain=plain)
    echo = as_ids = False
    note = None
    if endpoint == CHAT:
        token_ids = _unset(get("return_token_ids"))
        # vLLM refuses `top_logprobs` and `logprob_token_ids` without `logprobs`: ours
        # would make it accept them.
        logprobs = _unset(get("logprobs")) and get("top_logprobs") in (None, 0)
        logprobs = logprobs and not get("logprob_token_ids")
    else:  # text completions take a count of top logprobs; 0 means the sampled one
        token_ids = _unset(get("return_token_ids"))
        logprobs = get("logprobs") is None and not get("logprob_token_ids")
        echo = not _unset(get("echo"))
        if echo:
            ids_asked, token_ids = not token_ids, False  # ours would blank the echo
            many = get("n") not in (None, 1)
            beam = not _unset(get("use_beam_search"))
            logprobs = logprobs and not beam and not (not _unset(get("stream")) and many)
            as_ids = logprobs and not ids_asked
            as_ids = as_ids and get("return_tokens_as_token_ids") in (None, False, True)
            logprobs = logprobs and (ids_asked or as_ids)
            if as_ids:
                body["return_tokens_as_token_ids"] = True
            elif not ids_asked:
                note = ECHO_NO_IDS
    if token_ids:
        body["return_token_ids"] = True
    if logprobs:
        body["logprobs"] = True if endpoint == CHAT else 0
    usage = False
    stream = not _unset(get("stream"))
    if stream:
        options = get("stream_options") or {}
        if _unset(options.get("include_usage")):
            usage = True
            body["stream_options"] = {**options, "include_usage": True}
    return Additions(
        token_ids=token_ids,
        logprobs=logprobs,
        usage=usage,
        empty_chunks=stream and endpoint == CHAT and token_ids and logprobs,
        prompt_logprobs=echo and logprobs and get("prompt_logprobs") is None,
        echo=echo,
        as_ids=as_ids,
        note=note,
        plain=plain,
    )


def hide_additions(obj: dict, added: Additions) -> dict | None:
    """The response or chunk as the client would have got it without our additions.

    Returns None for a chunk that only exists because we asked for usage. Keys are
    nulled rather than deleted: that is what vLLM itself sends when not asked; `usage`
    is deleted, since vLLM leaves it unset on chunks when not asked (the client's
    `continuous_usage_stats` without `include_usage` gives no usage at all).
    """
    choices = obj.get("choices")
    if added.usage and "usage" in obj:
        if choices == []:
            return None
        del obj["usage"]
    if added.token_ids and obj.get("prompt_token_ids") is not None:
        obj["prompt_token_ids"] = None
    for choice in choices or ():
        if added.token_ids:
            if choice.get("token_ids") is not None:
                choice["token_ids"] = None
            if choice.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = None
        if added.logprobs and choice.get("logprobs") is not None:
            choice["logprobs"] = None
        if added.prompt_logprobs and choice.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = None
    return obj


def only_added(visible: dict) -> bool:
    """Whether a chunk, our additions hidden, carries nothing: every choice's delta empty
    and unfinished (vLLM would not have sent it had we not asked for ids and logprobs;
    a continuous usage count on it is dropped with it, as vLLM would not have sent it)."""
    choices = visible.get("choices")
    if not choices:
        return False
    for choice in choices:
        if choice.get("delta") or choice.get("finish_reason") is not None:
            return False
    return True


# -- a whole answer's bytes -------------------------------------------------------------


def hidden_answer(raw: bytes, obj: dict, added: Additions) -> bytes:
    """The whole answer `raw` (parsed: `obj`) as the client gets it: vLLM's own bytes
    with what we added nulled in place; re-encoded as vLLM encodes (`whole_dumps`) only
    where an edit cannot be placed with certainty. `obj` is changed only then."""
    edited = _null_in_place(raw, obj, added)
    return edited if edited is not None else whole_dumps(hide_additions(obj, added))


def _null_in_place(raw: bytes, obj: dict, added: Additions) -> bytes | None:
    """`raw` with each value we added replaced by null, or None if one cannot be placed.

    The keys are visited in the answer's order (orjson keeps vLLM's), each occurrence of
    a key we null, null or not, so that every one is found where it is. A key is found
    as `,"key":`, which in compact JSON only a key can be (inside a string every quote
    is escaped)."""
    out: list[bytes] = []
    pos = 0  # copied up to here
    nulled = _IN_CHOICES[added.token_ids, added.logprobs, added.prompt_logprobs]
    keys = list(obj)
    for i, key in enumerate(keys):
        if key == "choices" and isinstance(obj[key], list):
            for choice in obj[key]:
                inner = list(choice) if isinstance(choice, dict) else ()
                for j, name in enumerate(inner):
                    if name in nulled:
                        after = inner[j + 1] if j + 1 < len(inner) else None
                        pos = _place(raw, out, pos, name, choice[name], after)
                        if pos < 0:
                            return None
        elif key == "prompt_token_ids" and added.token_ids:
            pos = _place(raw, out, pos, key, obj[key], keys[i + 1] if i + 1 < len(keys) else None)
            if pos < 0:
                return None
    if not out:
        return raw
    out.append(raw[pos:])
    return b"".join(out)


# The keys of a choice to null, by what was added (token ids, logprobs, prompt logprobs).
_IN_CHOICES = {
    (ids, lps, prompt): frozenset(
        name
        for name, on in (
            ("token_ids", ids),
            ("prompt_token_ids", ids),
            ("logprobs", lps),
            ("prompt_logprobs", prompt),
        )
        if on
    )
    for ids in (False, True)
    for lps in (False, True)
    for prompt in (False, True)
}
_ID_LISTS = frozenset({"token_ids", "prompt_token_ids"})


def _place(raw: bytes, out: list[bytes], pos: int, key: str, value: Any, after: str | None) -> int:
    """Null `key`'s value, found from `pos` on (copying what is before it to `out`); the
    position copied up to next, or -1 where the edit cannot be placed with certainty.

    A list of ids ends at its first "]"; another value where the key `after` it begins:
    what we null holds no such key (logprobs of the sampled token only), and the value
    must open and close as one."""
    head = b',"' + key.encode() + b'":'
    start = raw.find(head, pos)
    if start < 0:
        return -1
    begin = start + len(head)
    if value is None:  # passed over: the search goes on after it
        if not raw.startswith(b"null", begin):
            return -1
        out.append(raw[pos:begin])
        return begin
    if key in _ID_LISTS:
        end = raw.find(b"]", begin) + 1
        if raw[begin] != 91 or end == 0:  # 91: "["
            return -1
    elif after is None:
        return -1
    else:
        end = raw.find(b',"' + after.encode() + b'":', begin)
        if end < 0 or raw[begin] not in b"{[" or raw[end - 1] not in b"}]":
            return -1
    out += (raw[pos:begin], b"null")
    return end
