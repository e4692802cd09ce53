"""What every format's reader shares: a source's lines parsed as JSON, one at a time,
each giving its calls or the reason it gives none (a bad line, counted and named)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import orjson

from .calls import BadLine, Call
from .sources import Item, documents, items

# What a reader yields: each line (or document) with its calls, or why it has none.
Read = tuple[Item, list[Call] | BadLine]


def parse(item: Item) -> object:
    if item.broken is not None:
        raise BadLine(item.broken)
    try:
        return orjson.loads(item.data)
    except orjson.JSONDecodeError as e:
        raise BadLine(f"not JSON ({e})") from None


def per_line(
    source: Path, read: Callable[[object, Item], list[Call]], whole: bool = False
) -> Iterator[Read]:
    """`read` on each line's JSON (each document's, `whole`: sources.documents): its
    calls, or its BadLine."""
    for item in documents(source) if whole else items(source):
        try:
            yield item, read(parse(item), item)
        except BadLine as e:
            yield item, e
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            yield item, BadLine(f"not a call of this format ({type(e).__name__}: {e})")


def error_text(error: object) -> str | None:
    """An error as one line of text: an OpenAI error object's message, else its JSON."""
    if error is None or error == {}:
        return None
    if isinstance(error, dict):
        inner = error.get("error") if isinstance(error.get("error"), dict) else error
        message = inner.get("message") or inner.get("error_message")
        code = inner.get("code") or inner.get("type") or inner.get("error_code")
        if message:
            return f"{code}: {message}" if code else str(message)
        return orjson.dumps(error).decode()
    return str(error)
