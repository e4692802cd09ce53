"""What the proxy keeps while requests pass: one request's `Capture`, the rollouts' turns,
the groups' sizes (for shadow sampling).

Below `records` (which turns a Capture into rows) and above the pure `capture` module
(the accumulator), so every layer imports downwards and the rows are built from typed
objects.
"""

from __future__ import annotations

import time
from typing import Any

from overnight.proxy.alias.promotions import Route
from overnight.storage import new_id
from overnight.storage.read.sent_by import CLIENT

from .apis import ResponsesAdditions
from .shapes import SHAPES


class Capture:
    """What one request produced, filled in as the response goes by."""

    # Slots: one Capture per request, its fields read and written on the hot path.
    __slots__ = (
        "request_id",
        "endpoint",
        "shape",
        "stream",
        "request_body",
        "route",
        "acc",
        "status",
        "error",
        "error_body",
        "t0",
        "ttft_ms",
        "latency_ms",
        "span",
        "sent_at",
        "first_chunk_at",
        "recipe",
        "plain",
        "answer",
        "sent_by",
    )

    def __init__(self, endpoint: str, stream: bool, request_body: dict, route: Route):
        self.request_id = new_id()
        self.endpoint = endpoint
        self.shape = SHAPES[endpoint]  # its API family (shapes.py): what differs by API
        self.stream = stream
        self.request_body = request_body
        self.route = route
        self.use()
        # `client`, or what of overnight's own sent it (routes/auth.py SENT_BY): its
        # record, its counters and its span say so.
        self.sent_by = CLIENT
        self.plain: str | None = None  # sent as the client sent it, and why (`sent_plain`)
        # With a recorder process (recorder.py): the bytes of each object the accumulator
        # was given, as the upstream sent them, for the recorder to give its own again.
        self.answer: list[bytes] | None = None
        self.status = 0
        self.error: str | None = None
        self.error_body: str | None = None
        self.t0 = time.perf_counter()
        self.ttft_ms: float | None = None
        self.latency_ms: float | None = None
        self.span: Any = None  # its OpenTelemetry span, when tracing is on (observe/tracing.py)
        # On the t0 clock, for the proxy's own time (observe/metrics.py): the request sent
        # upstream (its first try), a stream's first chunk written to the client.
        self.sent_at: float | None = None
        self.first_chunk_at: float | None = None

    def use(
        self,
        echo: bool = False,
        as_ids: bool = False,
        hidden: ResponsesAdditions | None = None,
        note: str | None = None,
    ) -> None:
        """This request's accumulator (its shape's: chat.py, apis.py), made from
        arguments a recorder process can make it again from: `recipe`."""
        self.recipe = (echo, as_ids, hidden, note)
        self.acc = self.shape.accumulator(*self.recipe)

    def add(self, data: bytes, obj: dict) -> None:
        """An object of the answer (a whole answer, or a stream's event), parsed from `data`."""
        self.acc.add(obj)
        if self.answer is not None:
            self.answer.append(data)

    def sent_plain(self, note: str) -> None:
        self.acc.sent_plain(note)
        self.plain = note

    def first_byte(self) -> None:
        if self.ttft_ms is None:
            self.ttft_ms = (time.perf_counter() - self.t0) * 1000

    def sent(self) -> None:
        if self.sent_at is None:
            self.sent_at = time.perf_counter()

    def done(self) -> None:
        self.latency_ms = (time.perf_counter() - self.t0) * 1000

    def fail(self, status: int | None, error: str) -> None:
        """The request ends here in `error`, its record's status `status` (None: the one
        the upstream answered with, as a stream cut short keeps its 200)."""
        if status is not None:
            self.status = status
        self.error = error
        self.done()


class TurnCounter:
    """Turn index per rollout, in the order this process saw them; bounded memory."""

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self.counts: dict[str, int] = {}

    def next(self, rollout_id: str) -> int:
        n = self.counts.pop(rollout_id, -1) + 1
        self.counts[rollout_id] = n  # re-inserted: most recent last
        if len(self.counts) > self.capacity:
            del self.counts[next(iter(self.counts))]
        return n


class GroupRollouts:
    """How many distinct rollouts this process has seen in each group; bounded memory.

    A turn is in a group of two or more once a second rollout of its group arrives, so
    the first rollout of a group is counted before its siblings exist (the proxy cannot
    see the future); requests with n > 1 are groups of their own and never reach here.
    """

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self.groups: dict[str, str | int] = {}  # group -> its one rollout id, or a count

    def add(self, group_id: str, rollout_id: str) -> int:
        """Note `rollout_id` in `group_id`; the number of rollouts seen in it (capped at 2)."""
        seen = self.groups.pop(group_id, None)
        if seen is None or seen == rollout_id:
            self.groups[group_id] = rollout_id  # re-inserted: most recent last
            if len(self.groups) > self.capacity:
                del self.groups[next(iter(self.groups))]
            return 1
        self.groups[group_id] = 2
        return 2
