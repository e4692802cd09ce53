"""The newest training runs, read cheaply: what the proxy's `/metrics` says of the nights.

A scrape comes every 15 s or so and the proxy must not open the whole store for it
(`open_db` parses every live log). A night's row in `training_runs` is compacted into
Parquet when `overnight train` exits (its writer compacts in process), so the Parquet
segments alone say how the last nights ended: only their listing is looked at each time,
and their few columns are read again only when the listing changed. A run whose row is
still in a log (a trainer killed before its compaction) counts once the next compaction
has moved it.

Each run is also counted for its policy (the `policy` in its config JSON; a run from
before policies has none: the proxy counts it for its default policy), so that the
metrics say how each policy's last nights ended, and how far the newest night that
measured it found the served adapter and its candidate from the base model (forgetting).

A run held its policy's cycle lease when its record says so (`metrics.cycle`: every night
since `overnight learn`, cron's too): those are cycles, counted by outcome (promoted,
refused by the gate, failed, trained without a promotion), with the loop's latency of the
promoted ones (each group's wait from its finish to its adapter serving), the minutes vLLM
slept for them where colocated, and when the last one ended and how long it took. Read
from the records, they survive any supervisor's restart and count cron's nights alike; a
cycle killed before its record counts once the next cycle records its resumed run.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

from overnight.storage.manifest import list_segments

log = logging.getLogger("overnight.storage")

COLUMNS = ("status", "started_at", "ended_at", "promoted_as", "config", "metrics")


@dataclass(frozen=True)
class LastRun:
    status: str  # trained | failed
    ended_at: float  # Unix seconds
    promoted: bool


CYCLE_OUTCOMES = ("promoted", "refused", "failed", "not_promoted")


@dataclass
class Cycles:
    """A policy's cycles (runs recorded under its cycle lease), as /metrics says them."""

    outcomes: dict[str, int] = field(default_factory=dict)  # cycles by CYCLE_OUTCOMES
    waits: list[float] = field(default_factory=list)  # groups' finish to serving, seconds
    asleep: float = 0.0  # seconds vLLM slept for them (colocated)
    last: tuple[float, float] | None = None  # the newest: (ended, seconds it took)

    def add(self, row: dict, metrics: dict, at: float | None) -> None:
        outcome = _outcome(row, metrics)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        delay = metrics["cycle"].get("to_serving")
        if isinstance(delay, dict) and isinstance(delay.get("waits"), list):
            self.waits += [float(w) for w in delay["waits"] if isinstance(w, int | float)]
        asleep = (metrics.get("maintenance") or {}).get("seconds")
        if isinstance(asleep, int | float):
            self.asleep += asleep
        started = row.get("started_at")
        newest = at is not None and (self.last is None or at > self.last[0])
        if newest and isinstance(started, dt.datetime):
            self.last = (at, max(0.0, at - started.timestamp()))


def _outcome(row: dict, metrics: dict) -> str:
    if row.get("status") == "failed":
        return "failed"
    if row.get("promoted_as") is not None:
        return "promoted"
    gate = metrics.get("gate")
    if isinstance(gate, dict) and gate.get("promote") is False:
        return "refused"
    return "not_promoted"


@dataclass
class Nights:
    """How a set of runs (all of them, or one policy's) ended."""

    counts: dict[str, int] = field(default_factory=dict)  # runs by status
    last: LastRun | None = None  # the newest run that ended
    last_trained_at: float | None = None  # when the newest trained run ended
    # The newest run's forgetting, where measured (trainer/gate/forgetting.py): when it
    # ended, and its figures (served, candidate, budget; nats per token from the base).
    forgetting: tuple[float, dict] | None = None
    cycles: Cycles = field(default_factory=Cycles)  # those that ran as cycles

    def add(self, status: str, at: float | None, promoted: bool, forgetting=None) -> None:
        self.counts[status] = self.counts.get(status, 0) + 1
        if at is None:
            return
        if forgetting and (self.forgetting is None or at > self.forgetting[0]):
            self.forgetting = (at, forgetting)
        if self.last is None or at > self.last.ended_at:
            self.last = LastRun(status, at, promoted)
        if status == "trained" and (self.last_trained_at is None or at > self.last_trained_at):
            self.last_trained_at = at


@dataclass(frozen=True)
class RunsSummary:
    listing: tuple  # the segments (name, size) it was read from
    counts: dict[str, int] = field(default_factory=dict)  # runs by status
    last: LastRun | None = None  # the newest run that ended
    last_trained_at: float | None = None  # when the newest trained run ended
    # The same by the run's policy (None: a run from before policies).
    by_policy: dict[str | None, Nights] = field(default_factory=dict)


def latest_runs(data_dir: str | Path, previous: RunsSummary | None = None) -> RunsSummary:
    """The runs by status and the newest ones; `previous` is returned as it is when the
    table's files have not changed since it was read."""
    segments = list_segments(Path(data_dir), "training_runs")
    listing = tuple((rel, segments.sizes.get(rel)) for rel in segments.rels)
    if previous is not None and previous.listing == listing:
        return previous
    every = Nights()
    by_policy: dict[str | None, Nights] = {}
    for path, _ in segments.readable(None):
        names = set(pq.read_schema(path).names)
        table = pq.read_table(path, columns=[c for c in COLUMNS if c in names])
        for row in table.to_pylist():
            status = row.get("status") or "unknown"
            ended = row.get("ended_at")
            at = ended.timestamp() if isinstance(ended, dt.datetime) else None
            promoted = row.get("promoted_as") is not None
            metrics = _json_object(row.get("metrics"))
            every.add(status, at, promoted)
            nights = by_policy.setdefault(_policy_of(row.get("config")), Nights())
            nights.add(status, at, promoted, _forgetting_of(metrics))
            if isinstance(metrics.get("cycle"), dict):
                nights.cycles.add(row, metrics, at)
    return RunsSummary(listing, every.counts, every.last, every.last_trained_at, by_policy)


def _policy_of(config: str | None) -> str | None:
    """The policy a run's config JSON names (None: before policies, or unreadable)."""
    try:
        policy = json.loads(config).get("policy") if config else None
    except (ValueError, AttributeError):
        return None
    return policy if isinstance(policy, str) else None


def _json_object(text: str | None) -> dict:
    """A run's metrics JSON ({} when absent or unreadable)."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _forgetting_of(metrics: dict) -> dict | None:
    """A run's forgetting figures (its metrics' gate.forgetting), None where unmeasured."""
    gate = metrics.get("gate")
    measured = gate.get("forgetting") if isinstance(gate, dict) else None
    if not isinstance(measured, dict):
        return None
    return {k: measured.get(k) for k in ("served", "candidate", "budget")}


class RunsCache:
    """`latest_runs` at most every `seconds` (a scrape may come every few); a failure to
    read is logged once and the last reading kept."""

    def __init__(self, data_dir: str | Path, seconds: float):
        self.data_dir, self.seconds = Path(data_dir), seconds
        self.summary: RunsSummary | None = None
        self._read_at = -seconds
        self._failed = False
        self._lock = threading.Lock()  # read from a worker thread; one reading at a time

    def read(self) -> RunsSummary | None:
        with self._lock:
            if time.monotonic() - self._read_at < self.seconds:
                return self.summary
            self._read_at = time.monotonic()
            try:
                self.summary = latest_runs(self.data_dir, self.summary)
                self._failed = False
            except Exception:
                if not self._failed:
                    log.exception("could not read the training runs in %s", self.data_dir)
                self._failed = True
            return self.summary
