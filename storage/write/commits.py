"""Which of the writer's rows are on disk, which were lost and why, and who waits to know.

The writer numbers each row it queues (`LogWriter.append`) and settles every batch here
once its fsync has returned or failed: each row is on disk, or lost with a reason.
`Commits.wait` is for a caller that must not answer before its row is on disk (a
posted reward): it returns once the row is, and raises `StoreUnavailable` as soon as it
is known that it never will be. A later row being written says nothing about an earlier
one, so lost rows are remembered by number, as runs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading

from overnight.errors import OvernightError

# How many runs of lost rows `wait_committed` remembers: it is called right after
# `append`, so only the latest few matter; a run is a batch, or more when batches fail
# one after another for the same reason.
LOST_RUNS_KEPT = 4096


class StoreUnavailable(OvernightError):
    """A row was not stored (the disk is full or read-only, the log could not be created,
    or the row could not be encoded). The proxy answers it as an OpenAI-shaped 503."""

    status = 503
    code = "store_unavailable"

    def __init__(self, message: str):
        super().__init__(message)
        self.type = "server_error"  # the proxy's own storage failed, not the upstream


class Commits:
    """The outcome of each row by its sequence number. `settle` is called by the writer
    thread (and by `append` for a row that comes after `close`); `wait` in any event loop."""

    def __init__(self) -> None:
        self.committed = 0  # the highest number on disk
        self.resolved = 0  # the highest number written or lost
        self.rows_committed = 0
        self.rows_lost = 0
        self._lost: collections.deque = collections.deque(maxlen=LOST_RUNS_KEPT)
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._waiters_lock = threading.Lock()

    async def wait(self, seq: int) -> None:
        """Return once row `seq` is on disk; raise `StoreUnavailable` once it is lost."""
        with self._waiters_lock:
            if seq > self.resolved:
                fut = asyncio.get_running_loop().create_future()
                self._waiters.append((seq, fut))
            else:
                fut = None
                why = self._lost_reason(seq)
        if fut is not None:
            why = await fut
        if why is not None:
            raise StoreUnavailable(f"the row is not stored: {why}")

    def settle(self, stored: list[int], lost: list[tuple[int, str]]) -> None:
        """Record the outcome of a batch and wake its waiters: None for a row on disk,
        the reason for a lost one."""
        self.rows_committed += len(stored)
        self.rows_lost += len(lost)
        reasons = dict(lost)
        with self._waiters_lock:
            for seq, why in lost:  # runs: a failing disk loses batch after batch
                last = self._lost[-1] if self._lost else None
                if last is not None and last[1] == seq - 1 and last[2] == why:
                    self._lost[-1] = (last[0], seq, why)
                else:
                    self._lost.append((seq, seq, why))
            if stored:
                self.committed = max(self.committed, stored[-1])
            self.resolved = max(self.resolved, *stored, *reasons)
            ready = [w for w in self._waiters if w[0] <= self.resolved]
            self._waiters = [w for w in self._waiters if w[0] > self.resolved]
        for seq, fut in ready:
            why = reasons[seq] if seq in reasons else self._lost_reason(seq)
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
                fut.get_loop().call_soon_threadsafe(_resolve, fut, why)

    def _lost_reason(self, seq: int) -> str | None:
        """Why row `seq` was lost, or None when it was written. Under `_waiters_lock`,
        or in the writer thread (the only one that changes `_lost`)."""
        for first, last, why in reversed(self._lost):
            if first <= seq <= last:
                return why
            if last < seq:
                return None
        return None


def _resolve(fut: asyncio.Future, why: str | None) -> None:
    if not fut.done():
        fut.set_result(why)
