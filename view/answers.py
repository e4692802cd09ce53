"""The answers' shapes per run (gaming, trainer/gate/gaming.py): plain text cells for the
report and /ui, read from what the run's row stored in `metrics` (`gate.gaming`: the
gate's held-out replies of the candidate, the served adapter and the base model;
`answers`: the served answers of the day before the night against the day before that).
"""

from __future__ import annotations

import json

# The SELECT's columns, after the run's id: its gate's shapes and the live ones (JSON).
COLUMNS = "json_extract(metrics, '$.gate.gaming'), json_extract(metrics, '$.answers')"
HEADERS = [
    "run",
    "ends in a question: candidate / served / base",
    "flatters",
    "length (chars)",
    "gaming check",
    "live: ends in a question, day (before)",
    "live: length",
    "live: conversations ended",
    "live: signals",
    "live: served by",
]


def answer_rows(runs: list[tuple]) -> list[list[str]]:
    """One row of cells per run that measured anything: (run_id, gaming, answers) each a
    JSON text or None, newest first as given."""
    out = []
    for run_id, gaming, answers in runs:
        g = _json(gaming)
        a = _json(answers)
        if not g and not a:
            continue
        out.append([str(run_id), *_gate_cells(g), *_live_cells(a)])
    return out


def _json(value):
    if value is None or isinstance(value, dict):
        return value
    return json.loads(value)


def _gate_cells(g: dict | None) -> list[str]:
    if not g:
        return ["-", "-", "-", "-"]
    sides = [g.get("candidate"), g.get("served"), g.get("base")]

    def three(key: str, fmt) -> str:
        return " / ".join("-" if s is None else fmt(s[key]) for s in sides)

    limits = [
        f"--gaming-limit {g['limit']:g}" if g.get("limit") is not None else "",
        f"--gaming-length-limit {g['length_limit']:g}" if g.get("length_limit") is not None else "",
    ]
    said = ", ".join(x for x in limits if x) or "no limit"
    check = "over: " + "; ".join(g["over"]) if g.get("over") else f"within ({said})"
    return [three("question", _pct), three("flattery", _pct), three("chars", _chars), check]


def _live_cells(a: dict | None) -> list[str]:
    if not a:
        return ["-", "-", "-", "-", "-"]
    day, before, shift = a.get("day") or {}, a.get("before") or {}, a.get("shift") or {}

    def pair(key: str, fmt, moved, of: str = "") -> str:
        now = "-" if not day.get("answers") or day.get(key) is None else fmt(day[key]) + of
        then = "-" if not before.get("answers") or before.get(key) is None else fmt(before[key])
        change = shift.get(key)
        return f"{now} ({then}){'' if change is None else ', ' + moved(change)}"

    kinds = day.get("kinds") or {}
    signals = ", ".join(f"{k} {v:.0%}" for k, v in kinds.items()) or "none"
    served = ", ".join(f"{m} ({n})" for m, n in (day.get("adapters") or {}).items()) or "-"
    return [
        pair("question", _pct, _points, f" of {day.get('answers', 0)}"),
        pair("chars", _chars, lambda v: f"{v:+.0%}"),
        pair("ended", _pct, _points),
        signals,
        served,
    ]


def _pct(v: float) -> str:
    return f"{v:.0%}"


def _points(v: float) -> str:
    return f"{v * 100:+.0f} pts"


def _chars(v: float) -> str:
    return f"{v:.0f}"
