"""Server-sent events, split incrementally from whatever byte chunks arrive.

Events end at a blank line. We keep each event's exact bytes so an event we do not
need to change is forwarded verbatim; no line-length limit applies (a first chunk
carrying a long prompt's token ids can be hundreds of kilobytes).
"""

from __future__ import annotations


class SSEParser:
    def __init__(self) -> None:
        self._buffer = b""
        self.done = False  # saw `data: [DONE]`

    def feed(self, chunk: bytes) -> list[bytes]:
        """Complete events (each with its trailing blank line) in this chunk."""
        buffer = self._buffer + chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        events = []
        start = 0
        while True:
            end = buffer.find(b"\n\n", start)
            if end < 0:
                break
            event = buffer[start : end + 2]
            events.append(event)
            if event.startswith(b"data: [DONE]"):
                self.done = True
            start = end + 2
        self._buffer = buffer[start:]
        return events

    @staticmethod
    def data_of(event: bytes) -> bytes | None:
        """The data field of an event (multi-line data joined), or None if it has none."""
        lines = [
            line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
        ]
        if not lines:
            return None
        return lines[0] if len(lines) == 1 else b"\n".join(lines)


def encode_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def with_data(event: bytes, data: bytes) -> bytes:
    """`event` with its data field replaced and its other fields (`event:`, `id:`) kept
    where they were: a Responses or Messages event names its type in `event:`."""
    lines = event.rstrip(b"\n").split(b"\n")
    out: list[bytes] = []
    placed = False
    for line in lines:
        if not line.startswith(b"data:"):
            out.append(line)
        elif not placed:  # the first data line carries the whole new data
            out.append(b"data: " + data)
            placed = True
    return b"\n".join(out) + b"\n\n"
