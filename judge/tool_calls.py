"""Siblings' tool calls, parsed by the parser that parsed the served turn's.

A sibling is sampled from vLLM's /v1/completions on the served turn's prompt token ids,
so vLLM answers with text: nothing parses tool calls out of it. The served turn came
from the chat endpoint, where the server's `--tool-call-parser` did. For the scorer to
compare like with like, a sibling keeps what vLLM sampled (`raw` in its stored
response, storage/read/siblings.py) and is parsed here, when per-turn groups are loaded for
scoring, with vLLM's own parser class of the same name (`ToolParserManager`), built
once a process. Training reads token ids and needs none of this; a served turn's own
response stays as vLLM parsed it.

Importing vLLM takes seconds, so it happens only when a run has per-turn groups to
load, never at import time, never in the proxy. Where vLLM is not installed (a batch
machine with the `train` extra only), hermes, the default, is read by
storage/read/siblings.py's own reader, which follows vLLM's; any other parser is an error
before the first group is scored.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from overnight.config import DEFAULT_TOOL_CALL_PARSER
from overnight.errors import ConfigError
from overnight.storage.read.siblings import (
    assistant_message,
    hermes_tool_calls,
    parses_tool_calls,
    tool_call,
)

log = logging.getLogger(__name__)

# What a tool parser found in a reply: (content, calls), or None for no call.
Parsed = tuple[str | None, list[dict]] | None
# A reader: (the reply's text as sampled, the served request, whether the text kept
# its special tokens) -> (the text as the chat endpoint decoded it, what it found).
Reader = Callable[[str, dict, bool], tuple[str, Parsed]]


@dataclass(frozen=True)
class ToolCallParser:
    """Reads tool calls out of a sibling's text. `name` '' reads none (the server ran
    no parser: its replies' calls stayed text too)."""

    name: str
    how: str  # said in the judge's summary
    read: Reader

    def parse(self, text: str, request: dict | None, special_tokens: bool = False) -> Parsed:
        """(content, calls) as the chat endpoint would have answered `request` with
        `text`, or None when it holds no call (malformed markup stays text)."""
        return self.decode(text, request, special_tokens)[1]

    def decode(
        self, text: str, request: dict | None, special_tokens: bool = False
    ) -> tuple[str, Parsed]:
        """The reply's text as the chat endpoint decoded it (without the special tokens
        `text` kept and the server's parser would not have), and what the parser found."""
        if not self.name or not parses_tool_calls(request):
            return text, None
        return self.read(text, request or {}, special_tokens)


def _no_calls(text: str, request: dict, special_tokens: bool) -> tuple[str, Parsed]:
    return text, None


def _hermes(text: str, request: dict, special_tokens: bool) -> tuple[str, Parsed]:
    return text, hermes_tool_calls(text)  # hermes keeps special tokens: nothing to drop


@functools.cache
def sibling_parser(
    name: str = DEFAULT_TOOL_CALL_PARSER, tokenizer: str | None = None
) -> ToolCallParser:
    """The parser named as the server's `--tool-call-parser` ('' for none), built with
    the served model's tokenizer (a path or name) when the parser needs one. Raises
    ConfigError for a name vLLM does not know or a parser that cannot be built."""
    if not name:
        return ToolCallParser("", "none (the server parses no tool calls)", _no_calls)
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        if name != DEFAULT_TOOL_CALL_PARSER:
            raise ConfigError(
                f"tool call parser {name!r} needs vLLM installed where the judge runs "
                f"(pip install vllm); without it only {DEFAULT_TOOL_CALL_PARSER!r} (read without vLLM) or ''"
            ) from None
        log.warning(
            "vLLM is not importable: siblings' tool calls are read with overnight's own "
            "hermes reader (storage/read/siblings.py), which follows vLLM 0.32's"
        )
        return ToolCallParser(name, "overnight's own hermes reader (vLLM not installed)", _hermes)
    try:
        parser_class = ToolParserManager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(sorted(ToolParserManager.list_registered()))
        raise ConfigError(f"vLLM has no tool call parser {name!r}; it has: {known}") from None
    vocabulary = _tokenizer(tokenizer) if tokenizer else _NoTokenizer()
    try:
        parser_class(vocabulary)  # what the server checked at its start
    except Exception as e:
        given = f"the tokenizer {tokenizer!r}" if tokenizer else "no tokenizer"
        raise ConfigError(
            f"vLLM's {name} tool call parser cannot be built with {given}: {e} "
            "(give the served model's tokenizer, e.g. its base model path)"
        ) from e
    special = tuple(sorted(_special_tokens(vocabulary), key=len, reverse=True))
    read = functools.partial(_vllm_read, parser_class, vocabulary, special)
    return ToolCallParser(name, f"vLLM's {name} parser", read)


def _tokenizer(path: str) -> Any:
    from vllm.tokenizers import get_tokenizer

    try:
        return get_tokenizer(path)
    except Exception as e:
        raise ConfigError(f"cannot load the tokenizer {path!r}: {e}") from e


class _NoTokenizer:
    """Stands in for the model's tokenizer when none is given: most parsers read only
    the text when not streaming (hermes, pythonic), and one that needs the model's
    vocabulary (llama3_json, mistral) fails to build with it, which is said at start."""

    def get_vocab(self) -> dict[str, int]:
        return {}

    def __bool__(self) -> bool:
        return True


def _vllm_read(
    parser_class: type,
    vocabulary: Any,
    special: tuple[str, ...],
    text: str,
    request: dict,
    special_tokens: bool,
) -> tuple[str, Parsed]:
    """One reply through a fresh parser instance, built as the server builds one per
    request (with the request's tools: some parsers cast arguments by their schema),
    the request adjusted by the parser first (which may keep special tokens), then the
    reply's text parsed. Whatever fails leaves the reply as text: the tools came from a
    client, and one odd request must not stop a night's scoring."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        # The parsers read the offered tools and the tool choice; the conversation
        # matters to none of them and need not validate.
        chat = ChatCompletionRequest(
            model=str(request.get("model") or "sibling"),
            messages=[{"role": "user", "content": ""}],
            tools=request.get("tools"),
            tool_choice=request.get("tool_choice") or "auto",
            skip_special_tokens=request.get("skip_special_tokens", True),
        )
        parser = parser_class(vocabulary, chat.tools)
        chat = parser.adjust_request(chat)
        if special_tokens and chat.skip_special_tokens:
            text = _without_special_tokens(text, special)
        found = parser.extract_tool_calls(text, chat)
    except Exception as e:  # tools vLLM refuses, or the chat endpoint would have failed
        _warn_once(parser_class, e)
        return text, None
    if not found.tools_called:
        return text, None
    calls = [
        tool_call(i, c.function.name, c.function.arguments) for i, c in enumerate(found.tool_calls)
    ]
    return text, (found.content, calls)


_warned: set[type] = set()


def _warn_once(parser_class: type, error: Exception) -> None:
    """A sibling the parser could not read is scored as text: said once per parser at
    warning (it biases a comparison with served tool calls), then at debug."""
    level = logging.DEBUG if parser_class in _warned else logging.WARNING
    _warned.add(parser_class)
    log.log(level, "vLLM's %s could not read a sibling's reply (%r); scored as text",
            parser_class.__name__, error, exc_info=level == logging.DEBUG)  # fmt: skip


def _without_special_tokens(text: str, special: tuple[str, ...]) -> str:
    """`text` less the tokenizer's special tokens (`special`, longest first), as
    decoding with them skipped gives (near enough: the reply's text, not its token ids,
    is at hand). Without the model's tokenizer none are known: the text stays."""
    for token in special:
        text = text.replace(token, "")
    return text


def _special_tokens(vocabulary: Any) -> set[str]:
    """What decoding with `skip_special_tokens` skips: the named special tokens and every
    added token marked special (Llama 3's `<|python_tag|>` is one of the latter)."""
    added = getattr(vocabulary, "added_tokens_decoder", None) or {}
    special = {t.content for t in added.values() if getattr(t, "special", False)}
    return special | set(getattr(vocabulary, "all_special_tokens", ()))


def reparsed(response: dict | None, request: dict | None, parser: ToolCallParser) -> dict | None:
    """A sibling's stored `response` with its message read from the text vLLM sampled
    by `parser`. A response that kept no text (a text-completion turn, a turn without
    tools, a row written before siblings kept it) is returned as stored."""
    choices = (response or {}).get("choices") or []
    raw = choices[0].get("raw") if choices and isinstance(choices[0], dict) else None
    if not isinstance(raw, dict) or not isinstance(raw.get("text"), str):
        return response
    kept = raw.get("skip_special_tokens") is False  # the text has the special tokens
    text, parsed = parser.decode(raw["text"], request, kept)
    message, finish = assistant_message(text, raw.get("finish_reason"), parsed)
    choice = {**choices[0], "message": message, "finish_reason": finish}
    return {**(response or {}), "choices": [choice, *choices[1:]]}
