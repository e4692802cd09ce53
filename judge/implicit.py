"""`overnight signals`: what happens next in each conversation, read from the store and
written as `signals` rows (the rules are judge/signals.py's).

Recent chat turns are read (a window, `since`), every signal is found again from scratch
(a turn's next message may have come after the last run), and only the signals not
written before are appended: a signal's id is a hash of what it is about and what said
so, so a second run over the same traffic writes nothing.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from overnight.storage import LogWriter, WriterConfig, now_us, open_db
from overnight.storage.schema import SCHEMA_VERSION

from .signals import Signal, Turn, read_signals

# A conversation quiet this long has ended: no next message is coming for its last turn.
QUIET_SECONDS = 30 * 60

TURNS_SQL = """
SELECT record_id, request_id, rollout_id, group_id, attribution, epoch_us(started_at),
       request, response, finish_reason
FROM completions
WHERE endpoint = 'chat.completions' AND coalesce(logged, true) AND error IS NULL
  AND coalesce(http_status, 200) = 200 AND started_at >= to_timestamp(?::DOUBLE / 1e6)
"""


@dataclass
class SignalSummary:
    turns: int = 0
    found: Counter = field(default_factory=Counter)  # kind -> signals found
    written: int = 0
    seconds: float = 0.0

    def lines(self) -> list[str]:
        kinds = ", ".join(f"{k} {n}" for k, n in self.found.most_common()) or "none"
        with_signal = self.found.total()
        return [
            f"read {self.turns} chat turn(s): {with_signal} signal(s) ({kinds}); "
            f"{self.written} new written in {self.seconds:.1f} s"
        ]


def turn_of(row: tuple) -> tuple[Turn, str] | None:
    """A `completions` row as the rules read it, with its group; None when its request or
    response is not a chat turn (unlogged bodies, odd JSON)."""
    record, request_id, rollout, group, attribution, started, request, response, finish = row
    try:
        body, answer = json.loads(request or "null"), json.loads(response or "null")
        messages = body["messages"]
        reply = answer["choices"][0]["message"]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(messages, list) or not isinstance(reply, dict):
        return None
    messages = [m for m in messages if isinstance(m, dict)]
    response_format = body.get("response_format")
    turn = Turn(
        record_id=record,
        request_id=request_id,
        rollout_id=rollout,
        attributed=attribution not in (None, "none"),
        started_at=int(started),
        messages=messages,
        reply=reply,
        finish_reason=finish,
        response_format=response_format if isinstance(response_format, dict) else None,
    )
    return turn, group


def find_signals(data_dir: Path, since_us: int, quiet_seconds: float = QUIET_SECONDS):
    """(the turns read with their groups, the signals found, the ids already written)."""
    con = open_db(data_dir)
    try:
        rows = con.execute(TURNS_SQL, [since_us]).fetchall()
        written = {r[0] for r in con.execute("SELECT signal_id FROM signals").fetchall()}
    finally:
        con.close()
    turns, groups = [], {}
    for row in rows:
        found = turn_of(row)
        if found is not None:
            turns.append(found[0])
            groups[found[0].record_id] = (found[0].rollout_id, found[1])
    signals = read_signals(turns, now_us(), int(quiet_seconds * 1e6))
    return groups, signals, written


def run_signals(
    data_dir: Path, since_seconds: float = 7 * 86400, quiet_seconds: float = QUIET_SECONDS
) -> SignalSummary:
    """Read the signals of the chat turns of the last `since_seconds` and write the new ones."""
    started = time.perf_counter()
    since = now_us() - int(since_seconds * 1e6)
    groups, signals, written = find_signals(data_dir, since, quiet_seconds)
    summary = SignalSummary(turns=len(groups), found=Counter(s.kind for s in signals))
    new = [s for s in signals if s.signal_id not in written]
    if new:
        writer = LogWriter(WriterConfig(Path(data_dir), compact_in_process=True))
        writer.start()
        try:
            for s in new:
                writer.append("signals", _row(s, *groups[s.record_id], writer.writer_id))
        finally:
            writer.close()
    summary.written = len(new)
    summary.seconds = time.perf_counter() - started
    return summary


def _row(s: Signal, rollout_id: str, group_id: str, writer_id: str) -> dict:
    return {
        "signal_id": s.signal_id,
        "schema_version": SCHEMA_VERSION,
        "created_at": now_us(),
        "record_id": s.record_id,
        "rollout_id": rollout_id,
        "group_id": group_id,
        "kind": s.kind,
        "value": s.value,
        "confidence": s.confidence,
        "rule": s.rule,
        "source": "rules",
        "evidence": s.evidence,
        "evidence_record": s.evidence_record,
        "extra": json.dumps(s.extra) if s.extra else None,
        "proxy_id": writer_id,
    }
