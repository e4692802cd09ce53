"""A streamed answer's events as the client gets them, each one fed to the capture.

Events the proxy need not change go out as the exact upstream bytes; a changed chat or
text chunk is re-encoded as vLLM encodes chunks (pydantic's JSON, which orjson writes
alike), a changed Responses event keeps its `event:` line. Either way the events keep
vLLM's order, choices of an `n > 1` answer interleaved as they came.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from overnight.proxy.forward.jsonio import json_dumps
from overnight.proxy.forward.sse import SSEParser, encode_event, with_data

from .additions import Additions, hide_additions, only_added
from .apis import ResponsesAdditions, hide_responses_additions

# What an event is given to: the request's Capture (`Capture.add`), with its bytes.
Take = Callable[[bytes, dict], None]


@dataclass(slots=True)
class SeenFingerprint:
    """vLLM's `system_fingerprint`, constant per server, once a stream has shown it.

    When the proxy asks for usage, vLLM moves the fingerprint from each choice's
    finishing chunk to the usage chunk the proxy drops; the relay puts it back from
    here (see `EventRelay`). `seen` tells a fingerprint of None from none yet. One per
    app (state.FINGERPRINT).
    """

    seen: bool = False
    value: Any = None


class EventRelay:
    """Turns upstream SSE bytes into what the client gets, giving each event to `take`.

    When we asked for usage, vLLM moves `system_fingerprint` from each choice's
    finishing chunk to the usage chunk we drop. The fingerprint is constant per server,
    so once seen (in any answer) it is put back at once; until then a finishing chunk
    waits for the usage chunk, and every event after it waits behind it, in order.
    """

    def __init__(self, added: Additions, take: Take, fingerprint: SeenFingerprint):
        self.added = added
        self.take = take
        self.fingerprint = fingerprint  # app-wide
        self.parser = SSEParser()
        self.held: list[dict | bytes] = []  # events behind a finishing chunk, in order

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self._event(e) for e in self.parser.feed(chunk))

    def flush(self) -> bytes:
        held, self.held = self.held, []
        fingerprint = self.fingerprint.value
        out = []
        for event in held:
            if isinstance(event, dict):
                if fingerprint is not None and _finishes(event):
                    event.setdefault("system_fingerprint", fingerprint)
                event = encode_event(json_dumps(event))
            out.append(event)
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        data = SSEParser.data_of(event)
        obj = None
        if data is not None and data != b"[DONE]":
            try:
                obj = orjson.loads(data)
            except ValueError:
                obj = None
        if not isinstance(obj, dict):
            return self._out(event)
        self.take(data, obj)
        if not self.added.any:
            return event
        fingerprint = self.fingerprint
        if "system_fingerprint" in obj:
            fingerprint.seen = True
            fingerprint.value = obj["system_fingerprint"]
        visible = hide_additions(obj, self.added)
        if visible is None:  # the usage chunk only we asked for: it names the fingerprint
            fingerprint.seen = True  # (as absent, when vLLM runs with --fingerprint-mode none)
            fingerprint.value = obj.get("system_fingerprint")
            return self.flush()
        if self.added.empty_chunks and only_added(visible):  # the record has taken it
            return b""
        if self.added.usage and _finishes(visible):
            if not fingerprint.seen:
                self.held.append(visible)
                return b""
            if fingerprint.value is not None:
                visible.setdefault("system_fingerprint", fingerprint.value)
        if self.held:
            self.held.append(visible)
            return b""
        return encode_event(json_dumps(visible))

    def _out(self, event: bytes) -> bytes:
        """An event passed as it came, behind what is held ([DONE], an error event)."""
        if not self.held:
            return event
        self.held.append(event)
        return self.flush() if event.startswith(b"data: [DONE]") else b""


def _finishes(chunk: dict) -> bool:
    return any(c.get("finish_reason") for c in chunk.get("choices") or ())


class ResponsesEventRelay(EventRelay):
    """A Responses stream: an event the proxy's additions changed is re-encoded with its
    `event:` line kept; every other event goes out as the exact upstream bytes."""

    def __init__(self, added: ResponsesAdditions, take: Take, fingerprint: SeenFingerprint):
        super().__init__(Additions(), take, fingerprint)
        self.responses_added = added

    def _event(self, event: bytes) -> bytes:
        data = SSEParser.data_of(event)
        try:
            obj = orjson.loads(data) if data is not None else None
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            return event
        self.take(data, obj)
        added = self.responses_added
        hidden = hide_responses_additions(obj, added) if added.any else None
        return event if hidden is None else with_data(event, json_dumps(hidden))


def learn_fingerprint(fingerprint: SeenFingerprint, answer: dict) -> None:
    """A whole answer names the server's fingerprint too (null when it has none)."""
    if not fingerprint.seen and "system_fingerprint" in answer:
        fingerprint.seen = True
        fingerprint.value = answer["system_fingerprint"]
