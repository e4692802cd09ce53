"""Progress lines for a long step: counts, rate and the time left at the pace so far.

A night says a line per training step (trainer/run/loop.py); a step with no steps of its
own (the gate's sampling and scoring, the forgetting pass) says one now and then through
`Progress`: every `EVERY` seconds or each quarter of the work, whichever comes first, and
a last line when it is done.
"""

from __future__ import annotations

import time
from collections.abc import Callable

EVERY = 10.0  # seconds between lines at the most (a quarter of the work may come sooner)
QUARTERS = 4


def untold(_done: int) -> None:
    """Where work done goes when no one counts it (a function's default `advance`)."""


def time_left(elapsed: float, done: int, left: int) -> str:
    """The time `left` more units take at the pace of the `done` ones (`elapsed` seconds)."""
    return f"about {elapsed / max(done, 1) * left:.0f} s left"


class Progress:
    """`what done/total unit, rate unit/s, about N s left` through `say`, now and then as
    `advance` counts the work done, and `what done unit in N s (rate unit/s)` at `finish`.
    `expect` adds work found on the way (before any of it is done, for a true estimate).
    `say` None: no lines (a caller that was given nowhere to say them)."""

    def __init__(
        self,
        say: Callable[[str], None] | None,
        what: str,
        total: int,
        unit: str,
        every: float = EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.say = say or (lambda _line: None)
        self.what, self.total, self.unit = what, total, unit
        self.every, self.clock = every, clock
        self.done = 0
        self.started = self.said = clock()
        self.quarter = 0  # the last quarter of the work a line was said for

    def expect(self, more: int) -> None:
        self.total += more

    def advance(self, done: int = 1) -> None:
        self.done += done
        now = self.clock()
        quarter = QUARTERS * self.done // max(self.total, 1)
        if self.done >= self.total or (quarter <= self.quarter and now - self.said < self.every):
            return  # the last line is finish's
        self.quarter, self.said = quarter, now
        elapsed = now - self.started
        self.say(
            f"{self.what} {self.done}/{self.total} {self.unit}, {self._rate(elapsed)}, "
            f"{time_left(elapsed, self.done, self.total - self.done)}"
        )

    def finish(self) -> None:
        elapsed = self.clock() - self.started
        self.say(f"{self.what} {self.done} {self.unit} in {elapsed:.0f} s ({self._rate(elapsed)})")

    def _rate(self, elapsed: float) -> str:
        rate = self.done / elapsed if elapsed > 0 else 0.0
        return f"{rate:.2g} {self.unit}/s" if rate < 10 else f"{rate:.0f} {self.unit}/s"
