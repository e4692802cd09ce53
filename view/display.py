"""Text views of a data directory for the CLI: `ls`, `show`, `runs`, `sql`, `export`."""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from overnight.config import LOGPROB_GAP_WARNING
from overnight.errors import OvernightError
from overnight.storage import segment_store
from overnight.storage.bucket import conditional
from overnight.storage.images import ImageStore
from overnight.storage.read.images import ImagePart, image_of
from overnight.storage.read.policy_scope import PolicyScope
from overnight.storage.read.sent_by import AGGREGATE_SENT_BY, CLIENT, shown


def _table(headers: list[str], rows: list[tuple]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return value.isoformat()  # a DATE (the views' `date` column) prints as one
    if hasattr(value, "strftime"):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    text = str(value)
    return text if len(text) <= 48 else text[:45] + "..."


# How far back from the newest turn the newest-first listings look, widening until they
# have enough groups: a time filter skips older files by their Parquet statistics, so a
# listing of the newest groups costs about the same at a year of history as at a day.
NEWEST_WINDOWS = (dt.timedelta(days=1), dt.timedelta(days=7), dt.timedelta(days=30))


def newest_groups(
    con: duckdb.DuckDBPyConnection,
    columns: str,
    order: str,
    limit: int,
    where: Sequence[str] = (),
    args: Sequence = (),
) -> list[tuple]:
    """`columns` of the `limit` groups newest by `order` (the `groups` view's started_at
    or ended_at) that match `where`, newest first. Only groups with a turn in a window
    back from now are aggregated (any group newer than the window's start has one); the
    window widens until it holds `limit`, and at last is everything."""
    condition = " AND ".join(["TRUE", *where])
    now = dt.datetime.now(dt.UTC)
    for window in NEWEST_WINDOWS:
        since = now - window
        ids = con.execute(
            f"SELECT DISTINCT group_id FROM completions WHERE {order} >= ?", [since]
        ).fetchall()
        # Literal values, not a subquery: a constant list is pushed down to the scan.
        marks = ",".join("?" * len(ids)) or "NULL"
        rows = con.execute(
            f"SELECT {columns} FROM groups WHERE group_id IN ({marks}) AND {order} >= ? "
            f"AND {condition} ORDER BY {order} DESC LIMIT {int(limit)}",
            [g for (g,) in ids] + [since, *args],
        ).fetchall()
        if len(rows) >= limit:
            return rows
    return con.execute(
        f"SELECT {columns} FROM groups WHERE {condition} ORDER BY {order} DESC LIMIT {int(limit)}",
        list(args),
    ).fetchall()


def list_groups(
    con: duckdb.DuckDBPyConnection,
    group: str | None,
    limit: int,
    policy: str | None = None,
    sent_by: str = CLIENT,
) -> str:
    """`overnight ls`: the newest groups (of those that asked for `policy`'s alias, sent by
    `sent_by`: the agents by default; storage/read/sent_by.py `shown`), each with the
    model its turns asked for (the policy) and its rollouts. A group named is shown
    whoever sent it."""
    columns = "group_id, rollouts, turns, tokens, mean_reward, finished, models_served, ended_at"
    columns += ", sent_by"
    # A policy's groups are those whose first turn asked for its alias, as its nights
    # choose them (storage/read/policy_scope.py; offline, no proxy says which others exist).
    where, args = [], []
    if policy is not None:
        condition, args = PolicyScope(policy, default=False).group_condition()
        where = [condition]
    mine = " AND ".join(["TRUE", *where])  # on the turns, for the counts below
    mine_args = list(args)
    sent, sent_args = shown("sent_by", sent_by)
    if not group:
        where, args = [*where, sent], [*args, *sent_args]
    if group:
        groups = con.execute(
            f"SELECT {columns} FROM groups WHERE group_id = ? AND {' AND '.join(['TRUE', *where])}",
            [group, *args],
        ).fetchall()
    else:
        groups = newest_groups(con, columns, "ended_at", limit, where, args)
    if not groups:
        if policy is not None:
            return f"no group asked for the policy {policy!r}" + (f" as {group!r}" if group else "")
        if not group:
            return _none_sent_by(con, sent_by)
        return f"no group {group!r}"
    out = [_sent_by_counts(con, sent_by, mine, mine_args, len(groups)), ""]
    out += _group_blocks(con, groups)
    return "\n".join(out).rstrip()


def _group_blocks(con: duckdb.DuckDBPyConnection, groups: list[tuple]) -> list[str]:
    """`overnight ls`'s lines for the listed groups: each one's line, then its rollouts."""
    out: list[str] = []
    # One query for the rollouts of every shown group, not one per group: each query
    # aggregates the rewards and judgments again.
    by_group: dict[str, list[tuple]] = {g[0]: [] for g in groups}
    # And the upstream each was served through, where it was a hosted API (its records
    # name it in `notes`; vLLM's do not).
    asked, via = {}, {}
    for group_id, models, upstreams in con.execute(
        "SELECT group_id, string_agg(DISTINCT model_requested, ',' ORDER BY model_requested), "
        "string_agg(DISTINCT json_extract_string(notes, '$.upstream'), ',') "
        f"FROM completions WHERE group_id IN ({','.join('?' * len(by_group))}) "
        "GROUP BY group_id",
        list(by_group),
    ).fetchall():
        asked[group_id], via[group_id] = models, upstreams
    for row in con.execute(
        "SELECT group_id, rollout_id, turns, prompt_tokens, completion_tokens, reward, "
        "reward_source, judge_score, finished_at IS NOT NULL, models_served, errors FROM rollouts "
        f"WHERE group_id IN ({','.join('?' * len(by_group))}) ORDER BY started_at",
        list(by_group),  # literal values: pushed down to the scan, as a subquery is not
    ).fetchall():
        by_group[row[0]].append(row[1:])
    for g in groups:
        out.append(
            f"group {g[0]}: {g[1]} rollout(s), {g[2]} turn(s), {g[3]} tokens, "
            f"mean reward {_cell(g[4])}, {g[5]} finished, asked for {asked.get(g[0]) or '-'}, "
            f"served by {g[6]}"
            + (f" via {via[g[0]]}" if via.get(g[0]) else "")
            + (f", sent by overnight ({g[8]})" if g[8] != CLIENT else "")
        )
        rollouts = by_group[g[0]]
        table = _table(
            [
                "rollout",
                "turns",
                "prompt",
                "completion",
                "reward",
                "source",
                "judge",
                "finished",
                "served by",
                "errors",
            ],
            rollouts,
        )
        out.append("\n".join("  " + line for line in table.splitlines()))
        out.append("")
    return out


def _group_senders(con: duckdb.DuckDBPyConnection, mine: str, args: list) -> dict[str, tuple]:
    """(groups, rollouts) by who sent the group, counted on the turns (the `groups` view
    would aggregate every rollout to count them)."""
    rows = con.execute(
        f"SELECT sent_by, count(*), sum(rollouts) FROM (SELECT "
        f"{AGGREGATE_SENT_BY.format(column='sent_by')} AS sent_by, count(DISTINCT rollout_id) "
        f"AS rollouts FROM completions WHERE {mine} GROUP BY group_id) GROUP BY sent_by",
        args,
    ).fetchall()
    return {kind: (n, rollouts) for kind, n, rollouts in rows}


def _sent_by_counts(con, sent_by: str, mine: str, args: list, shown_now: int) -> str:
    """The listing's first line: the groups and rollouts of those it lists, and how to
    list overnight's own (or the agents') where there are any."""
    counts = _group_senders(con, mine, args)
    own = [(k, n) for k, (n, _) in sorted(counts.items()) if k != CLIENT]
    listed = [
        v for k, v in counts.items()
        if sent_by == "all" or k == sent_by or (sent_by == "own" and k != CLIENT)
    ]  # fmt: skip
    groups, rollouts = sum(n for n, _ in listed), sum(r for _, r in listed)
    line = f"{groups} group(s), {rollouts} rollout(s); newest {shown_now} shown"
    if sent_by == CLIENT and own:
        kinds = ", ".join(f"{n} {k}" for k, n in own)
        line += f" (and overnight's own: {kinds}; `--sent-by own` lists them)"
    elif sent_by != CLIENT and CLIENT in counts:
        line += f" (and the agents': {counts[CLIENT][0]}; `--sent-by client` lists them)"
    return line


def _none_sent_by(con: duckdb.DuckDBPyConnection, sent_by: str) -> str:
    """What `overnight ls` says when nothing sent by `sent_by` is recorded."""
    total = con.execute("SELECT count(DISTINCT group_id) FROM completions").fetchone()[0]
    if not total:
        return "no records yet"
    return f"no group sent by {sent_by!r} ({total} group(s) by others; `--sent-by all` lists them)"


@dataclass
class ShownTurn:
    index: int
    started_at: object
    served_by: str | None
    tokens: int
    latency_ms: float
    finish_reason: str | None
    error: str | None
    messages: list[dict]  # what is new since the turn before, then the reply
    # What happened next says of it (the `signals` table, `overnight signals`): dicts of
    # kind, value, confidence, rule, evidence.
    signals: list[dict] = field(default_factory=list)


@dataclass
class ShownRollout:
    """One rollout as `overnight show` and the web view present it."""

    rollout_id: str
    group_id: str
    reward: float | None
    reward_source: str | None
    finished: bool
    judge_score: float | None
    judge_explanation: str | None
    judge_model: str | None
    turns: list[ShownTurn]
    sent_by: str = CLIENT  # an agent, or what of overnight's own (storage/read/sent_by.py)


def load_rollout(con: duckdb.DuckDBPyConnection, rollout_id: str) -> ShownRollout:
    turns = con.execute(
        "SELECT turn_index, started_at, model_served, request, response, finish_reason, error, "
        "len(completion_token_ids), latency_ms, group_id, record_id FROM completions "
        "WHERE rollout_id = ? "
        "ORDER BY started_at, turn_index",
        [rollout_id],
    ).fetchall()
    if not turns:
        raise OvernightError(
            f"no rollout {rollout_id!r} (see `overnight ls`)", status=404, code="not_found"
        )
    reward, source, finished, score, explanation, judge, sent_by = con.execute(
        "SELECT reward, reward_source, finished_at, judge_score, judge_explanation, judge_model, "
        "sent_by FROM rollouts WHERE rollout_id = ?",
        [rollout_id],
    ).fetchone()
    signals = _signals_of(con, [row[-1] for row in turns])
    shown, seen = [], 0
    for (
        turn,
        started,
        served,
        request,
        response,
        finish,
        error,
        n_tokens,
        latency,
        _,
        record,
    ) in turns:
        messages = _messages(_object(request).get("messages"))
        # Only what is new since the last turn: the agent resends its history.
        start = seen if len(messages) > seen else 0
        seen = len(messages) + 1
        replies = [
            _message(choice.get("message") or {"role": "assistant", "content": choice.get("text")})
            for choice in _list(_object(response).get("choices"))
            if isinstance(choice, dict)
        ]
        shown.append(
            ShownTurn(
                turn,
                started,
                served,
                n_tokens or 0,
                latency or 0.0,
                finish,
                error,
                messages[start:] + replies,
                signals.get(record, []),
            )
        )
    return ShownRollout(
        rollout_id,
        turns[0][9],
        reward,
        source,
        finished is not None,
        score,
        explanation,
        judge,
        shown,
        sent_by,
    )


# A record holds whatever the client sent, which need not be a valid request (`"messages":
# "hi"`, a part with `"text": 5`): the upstream refused it, the proxy logged it, and these
# views must still show it. Anything not of the expected shape is shown as its JSON.


def _object(text: str | None) -> dict:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _text(value) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _message(value) -> dict:
    return value if isinstance(value, dict) else {"role": "?", "content": _text(value)}


def _messages(value) -> list[dict]:
    if value is None:
        return []
    return [_message(m) for m in value] if isinstance(value, list) else [_message(value)]


def message_parts(
    message: dict, images: ImageStore | None = None
) -> tuple[str, str, list[tuple[str, str]]]:
    """(role, text, [(tool name, arguments)]) of a chat message; content parts joined,
    an image as its label (`image_label`: its reference, media type and size; `images`
    the store that knows a stored one's size), never its base64."""
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(_part_text(p, images) for p in content)
    calls = []
    for call in _list(message.get("tool_calls")):
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            calls.append((_text(fn.get("name")), _text(fn.get("arguments"))))
        else:
            calls.append(("?", _text(call)))
    return _text(message.get("role", "?")), _text(content), calls


def _signals_of(con: duckdb.DuckDBPyConnection, records: list[str]) -> dict[str, list[dict]]:
    """Each record's signals, surest first."""
    rows = con.execute(
        "SELECT record_id, kind, value, confidence, rule, evidence FROM signals "
        "WHERE record_id IN (SELECT unnest(?)) ORDER BY confidence DESC, kind",
        [records],
    ).fetchall()
    out: dict[str, list[dict]] = {}
    for record, kind, value, confidence, rule, evidence in rows:
        out.setdefault(record, []).append(
            {"kind": kind, "value": value, "confidence": confidence, "rule": rule,
             "evidence": evidence}
        )  # fmt: skip
    return out


def _part_text(part, images: ImageStore | None) -> str:
    if not isinstance(part, dict):
        return _text(part)
    image = image_of(part)
    if image is not None:
        return image_label(image, images)
    return _text(part.get("text", f"<{part.get('type')}>"))


def image_label(image: ImagePart, images: ImageStore | None = None) -> str:
    """`<image sha256:1f2e3d4c5b6a… image/png 12.3 KB>`, `<image inline image/png 12.3 KB
    (not stored)>`, `<image https://...>`: what an image is, in one short line."""
    if image.kind == "url":
        return f"<image {_short(image.url or '?')}>"
    size = image.size
    if image.kind == "stored" and images is not None:
        found = images.find(image.digest or "")
        size = found[1] if found else None
    said = _bytes(size) if size is not None else "missing from the store"
    if image.kind == "stored":
        return f"<image sha256:{(image.digest or '')[:12]}… {image.media_type} {said}>"
    return f"<image inline {_short(image.media_type or '?')} {said} (not stored)>"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000 or unit == "MB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def signal_line(s: dict) -> str:
    """One signal as `overnight show` and the web view print it."""
    said = f": {s['evidence']!r}" if s["evidence"] else ""
    return f"{s['kind']} ({s['value']:+g}, confidence {s['confidence']:g}): {s['rule']}{said}"


def show_rollout(
    con: duckdb.DuckDBPyConnection, rollout_id: str, data_dir: Path | None = None
) -> str:
    """A rollout turn by turn; `data_dir`: where its images' sizes are looked up."""
    r = load_rollout(con, rollout_id)
    images = ImageStore(data_dir) if data_dir is not None else None
    out = [
        f"rollout {r.rollout_id} in group {r.group_id}: {len(r.turns)} turn(s), "
        f"reward {_cell(r.reward)} ({r.reward_source or 'none'}), "
        f"{'finished' if r.finished else 'not finished'}"
        + (f", sent by overnight ({r.sent_by})" if r.sent_by != CLIENT else "")
    ]
    if r.judge_score is not None:
        out.append(f"judge {r.judge_model}: {r.judge_score:.3f}: {r.judge_explanation}")
    for t in r.turns:
        out.append("")
        out.append(
            f"--- turn {t.index} at {_cell(t.started_at)} served by {t.served_by}, "
            f"{t.tokens} tokens, {t.latency_ms:.0f} ms, finish {t.finish_reason}"
        )
        for message in t.messages:
            role, text, calls = message_parts(message, images)
            out.append(f"[{role}] {text}" if text else f"[{role}]")
            out += [f"  -> {name}({arguments})" for name, arguments in calls]
        if t.error:
            out.append(f"[error] {t.error}")
        out += [f"[next] {signal_line(s)}" for s in t.signals]
    return "\n".join(out)


def adapter_events(data_dir: Path, policy: str | None = None) -> list[dict]:
    """Rollbacks and canary decisions with their reasons, each with its `policy`, from
    every policy's promotion state (of `policy`'s only, when given): DATA/adapters.json
    (with a bucket its `adapters.json`: a machine that never ran a proxy has no local
    copy; the local copy when the bucket cannot be read) and DATA/policies/*/adapters.json
    (proxy/alias/promotions.py lays them out), oldest first."""
    text = None
    store = segment_store(data_dir)
    if store.remote:
        with contextlib.suppress(OSError):
            text, _ = conditional.get(store.fs, store.url, store.key("adapters.json"))
    texts = [text] if text is not None else []
    paths = [] if texts else [Path(data_dir) / "adapters.json"]
    paths += sorted((Path(data_dir) / "policies").glob("*/adapters.json"))
    for path in paths:
        with contextlib.suppress(OSError):
            texts.append(path.read_bytes())
    events = []
    for text in texts:
        try:
            state = json.loads(text)
            alias = state.get("alias")
            if policy is None or alias == policy:
                events += [{**e, "policy": alias} for e in state.get("events", [])]
        except (ValueError, AttributeError):
            continue
    return sorted(events, key=lambda e: str(e.get("at")))


# A training run's policy (SQL on `training_runs`): in its metrics (and its config), not a
# column of its own, so no schema change; a run from before policies says none ("").
RUN_POLICY = (
    "coalesce(json_extract_string(metrics, '$.policy'), "
    "json_extract_string(config, '$.policy'), '')"
)


def list_runs(
    con: duckdb.DuckDBPyConnection,
    limit: int,
    events: Sequence[dict] = (),
    policy: str | None = None,
) -> str:
    """`overnight runs`: the newest runs (of `policy`, when given), each with its policy,
    with the gap between logged and recomputed logprobs before each run's first update,
    and a note on the ones large enough to matter; then the latest rollbacks and canary
    decisions (`events`, adapter_events) and why."""
    where, args = (f"WHERE {RUN_POLICY} = ?", [policy]) if policy is not None else ("", [])
    rows = con.execute(
        "SELECT run_id, status || CASE WHEN json_extract_string(metrics, '$.objective') = 'sft' "
        "THEN ' (sft)' ELSE '' END, len(groups), rollouts, steps, trained_tokens, reward_mean, "
        "max_logprob_gap, promoted_as, started_at, json_extract_string(metrics, '$.gate.verdict'), "
        "json_extract_string(metrics, '$.gate.reason'), "
        "json_extract_string(metrics, '$.logprob_gaps'), "
        f"CAST(json_extract(metrics, '$.maintenance.seconds') AS DOUBLE), {RUN_POLICY}, "
        "CAST(json_extract(metrics, '$.gate.forgetting.candidate') AS DOUBLE), "
        "json_extract_string(metrics, '$.cycle.by'), json_extract_string(metrics, '$.cycle.trigger') "
        f"FROM training_runs {where} ORDER BY started_at DESC LIMIT {int(limit)}",
        args,
    ).fetchall()
    headers = ["run_id", "policy", "status", "groups", "rollouts", "steps", "trained_tokens"]
    headers += ["reward_mean", "logprob_gap", "stale_gap", "promoted_as", "started_at", "gate"]
    headers += ["asleep_s"]  # a colocated night's window: vLLM asleep, requests held
    # The candidate's drift from the base model on the reference set, nats per token
    # (trainer/gate/forgetting.py): the forgetting curve, night by night.
    headers += ["forgetting"]
    headers += ["by"]  # `train` (by hand, cron) or `learn` (its trigger below): night/cycles.py
    shown = [
        r[:1] + (r[14],) + r[1:7] + (_gap(r[7]), _number(stale_gap(r[12]))) + r[8:11]
        + (_number(r[13]), _number(r[15]), (r[16] or "-").removeprefix("overnight "))
        for r in rows
    ]  # fmt: skip
    out = _table(headers, shown) + f"\n({len(rows)} row(s))"
    out += "".join(f"\n{r[0]}: a cycle of {r[16]}: {r[17]}" for r in rows if r[17])
    # Why the gate refused (trainer/gate/verdict.py): the candidate stays on disk, unserved.
    out += "".join(f"\n{r[0]}: gate refused: {r[11]}" for r in rows if r[10] == "refused")
    shown_events = [e for e in events if e.get("action") != "promote"][-int(limit) :]
    out += "".join(
        f"\n{e.get('at')}: {e.get('policy') or ''}{': ' if e.get('policy') else ''}"
        f"{e.get('action')} {e.get('adapter')}, then served "
        f"{e.get('serves') or 'the base model'}: {e.get('reason') or 'no reason given'}"
        for e in reversed(shown_events)
    )
    large = [r[0] for r in rows if r[7] is not None and r[7] > LOGPROB_GAP_WARNING]
    if large:
        out += (
            f"\nwarning: logprob gap above {LOGPROB_GAP_WARNING} (marked !) in {', '.join(large)}: "
            "on records the starting adapter sampled itself, the trainer's logprobs differ from "
            "what vLLM logged: serving and training disagree (dtype, logprobs mode; docs/grpo.md)"
        )
    if any(stale_gap(r[12]) is not None for r in rows):
        out += (
            "\nstale_gap: the same gap on records sampled by earlier adapters: drift, weighed "
            "by the importance ratios (--max-staleness 0 leaves such records out)"
        )
    return out


def stale_gap(gaps: str | dict | None) -> float | None:
    """The largest first-step logprob gap of a run's records sampled by earlier adapters
    (its `metrics.logprob_gaps`, by age); None when it trained none."""
    if isinstance(gaps, str):
        gaps = json.loads(gaps)
    ages = [g["max_gap"] for age, g in (gaps or {}).items() if age not in ("0", "unknown")]
    return max(ages) if ages else None


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def _gap(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2g}" + (" !" if value > LOGPROB_GAP_WARNING else "")


def run_query(con: duckdb.DuckDBPyConnection, query: str, fmt: str) -> str:
    result = con.execute(query)
    headers = [d[0] for d in result.description or []]
    rows = result.fetchall()
    if fmt == "json":
        return "\n".join(json.dumps(dict(zip(headers, r, strict=True)), default=str) for r in rows)
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(headers)
        writer.writerows(rows)
        return buffer.getvalue().rstrip("\n")
    return _table(headers, rows) + f"\n({len(rows)} row(s))"


def export(con: duckdb.DuckDBPyConnection, table: str, fmt: str, out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    option = "FORMAT parquet, COMPRESSION zstd" if fmt == "parquet" else "FORMAT json"
    con.execute(f"COPY (SELECT * FROM {table}) TO '{_quote(out)}' ({option})")
    return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def _quote(path: Path) -> str:
    return str(path).replace("'", "''")
