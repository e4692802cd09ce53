"""A line on a policy's recent cycles (issue 51): how many, how often, how they ended, and
the loop's latency, for `overnight runs`, the training report and /ui's runs page.

A cycle is a run recorded under its policy's cycle lease (`metrics.cycle`: `overnight
learn`'s, and every `overnight train` night's since); /metrics says the same figures over
all time (proxy/observe/shared.py), this line over the last day.
"""

from __future__ import annotations

import json
import statistics
import time

from .display import RUN_POLICY

WINDOW_HOURS = 24.0


def cycle_line(con, policy: str | None = None, now: float | None = None) -> str | None:
    """`cycles in the last 24 h: 6 (0.5 per hour): 4 promoted, 1 refused by the gate, 1
    failed; serving a median 4.2 min after their data was in (8 groups)`; None without any.
    The rate is over the window, or since the first of them began when that is later."""
    now = time.time() if now is None else now
    where, args = (f"AND {RUN_POLICY} = ?", [policy]) if policy is not None else ("", [])
    rows = con.execute(
        "SELECT status, promoted_as IS NOT NULL, "
        "json_extract_string(metrics, '$.gate.promote'), epoch_us(started_at), "
        "json_extract(metrics, '$.cycle.to_serving.waits') FROM training_runs "
        "WHERE json_extract(metrics, '$.cycle') IS NOT NULL "
        f"AND epoch_us(ended_at) >= ? {where}",
        [int((now - WINDOW_HOURS * 3600) * 1e6), *args],
    ).fetchall()
    if not rows:
        return None
    outcomes = {"promoted": 0, "refused by the gate": 0, "failed": 0, "not promoted": 0}
    waits: list[float] = []
    for status, promoted, promote, _, delay in rows:
        if status == "failed":
            outcomes["failed"] += 1
        elif promoted:
            outcomes["promoted"] += 1
        elif promote == "false":
            outcomes["refused by the gate"] += 1
        else:
            outcomes["not promoted"] += 1
        waits += json.loads(delay) if isinstance(delay, str) else (delay or [])
    first = min(us for *_, us, _ in rows if us is not None) / 1e6
    hours = max(min(WINDOW_HOURS, (now - first) / 3600), 1 / 60)
    said = ", ".join(f"{n} {what}" for what, n in outcomes.items() if n)
    line = (f"cycles in the last {WINDOW_HOURS:g} h: {len(rows)} ({len(rows) / hours:.2g} per "
            f"hour): {said}")  # fmt: skip
    if waits:
        line += (f"; serving a median {statistics.median(waits) / 60:.1f} min after their "
                 f"data was in ({len(waits)} groups)")  # fmt: skip
    return line
