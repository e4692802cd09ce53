"""A completion's observations counted in plain numbers, for the metrics' series.

prometheus_client takes a lock and walks a histogram's buckets on every `inc` and
`observe`; metrics.py counts each finished completion into a `Tally` of its kind instead
and adds the tally to the series in one go (`Tally.add_to`) when they are read.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

Bounds = tuple[float, ...]  # a histogram's upper bounds, +Inf left out


class Tally:
    """One kind of request's observations since they were last added to its series.
    (Five series a completion, observed one by one, cost ~6 µs of the proxy's core at
    c16, its largest share of work after the record.)"""

    __slots__ = ("requests", "duration", "first_chunk", "own_time", "prompt", "generated")

    def __init__(self, duration: Bounds, first_chunk: Bounds, own_time: Bounds) -> None:
        self.requests = self.prompt = self.generated = 0
        self.duration = Buckets(duration)
        self.first_chunk = Buckets(first_chunk)
        self.own_time = Buckets(own_time)

    def add_to(self, c: Any) -> None:
        """Into one kind of request's series (metrics.py's `_Children`); then the tally
        starts again from zero (kept, not made anew: under --workers N this runs for
        every completion)."""
        if not self.requests:
            return
        c.requests.inc(self.requests)
        self.duration.add_to(c.duration)
        self.first_chunk.add_to(c.first_chunk)
        self.own_time.add_to(c.own_time)
        if self.prompt:
            c.prompt_tokens.inc(self.prompt)
        if self.generated:
            c.generation_tokens.inc(self.generated)
        self.requests = self.prompt = self.generated = 0


class Buckets:
    """A histogram's observations as counts per bucket (the first bound at or above the
    value, +Inf last, as prometheus_client's `observe` picks it) and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def add_to(self, histogram: Any) -> None:
        """Add these counts to a labelled Histogram, as that many `observe` calls would.
        Through its value objects (`_buckets`, `_sum`: prometheus_client's own, in memory
        or in the --workers files alike); tests/test_metrics.py holds the result to
        `observe`'s, so a prometheus_client that keeps them otherwise fails there. Then
        the counts start again from zero."""
        if not any(self.counts):
            return
        histogram._sum.inc(self.total)
        for i, (bucket, n) in enumerate(zip(histogram._buckets, self.counts, strict=True)):
            if n:
                bucket.inc(n)
                self.counts[i] = 0
        self.total = 0.0
