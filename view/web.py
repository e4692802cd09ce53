"""The read-only web view at /ui: server-rendered pages over the data directory.

    /ui                       groups, newest first, with filters (query parameters)
    /ui/groups/{group}        a group's rollouts: reward, judge score and explanation
    /ui/rollouts/{rollout}    one conversation turn by turn, tool calls included
    /ui/adapters              adapter versions: the promotion stack, and when each served
    /ui/runs                  training runs, with reward and loss curves

Plain HTML and inline SVG, no script and nothing fetched: it works on a machine with
no network, and a filter is a link that can be shared. Each page opens its own DuckDB
over the Parquet segments and live logs (as `overnight ls` does), in a worker thread
so the event loop keeps forwarding traffic.

An aiohttp sub-application (`create_web_view`), mounted at /ui by the proxy. Access is
the admin API's, checked by the proxy's middleware: the admin token (as a bearer token,
or once as `?token=`, which the middleware answers with a random session id in the
`COOKIE`), else loopback clients only.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import html
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from aiohttp import web

from overnight.errors import OvernightError
from overnight.storage import open_db
from overnight.view.charts import training_charts
from overnight.view.display import load_rollout, message_parts, newest_groups

COOKIE = "overnight_ui"  # a session id the proxy's middleware issues and checks

# What the view reads, through `request.config_dict`: set on the parent app by whoever
# mounts the view (the proxy's create_app). The keys live here, not in the proxy: view/
# imports neither the proxy, the judge nor the trainer, so the proxy imports them from
# the layer below and nothing imports the app module back (no import cycle).
DATA_DIR = web.AppKey("data_dir", Path)
# The adapter registry's `describe()`: alias, current adapter, promotion history.
ADAPTER_STATE = web.AppKey[Callable[[], dict]]("adapter_state")
# POSTs that produced model output on paths the proxy forwards but does not record:
# path -> count, since the proxy started. Optional: a view mounted without it shows none.
UNCAPTURED = web.AppKey[Callable[[], dict[str, int]]]("uncaptured")

STYLE = """
body{font:14px system-ui,sans-serif;margin:0;color:#111}
header{background:#111;color:#fff;padding:.6em 1.5em}header a{color:#fff;margin-right:1.5em}
main{padding:1em 1.5em;max-width:1300px}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f4f4f5}
td.num{text-align:right;font-variant-numeric:tabular-nums}
form.filters{display:flex;gap:.8em;flex-wrap:wrap;align-items:end;margin:.5em 0}
form.filters label{display:flex;flex-direction:column;font-size:12px;color:#555}
.turn{border:1px solid #e4e4e7;border-radius:6px;margin:.8em 0;padding:.5em .8em}
.meta{color:#666;font-size:12px}.msg{white-space:pre-wrap;margin:.4em 0;padding:.4em .6em;
border-left:3px solid #ccc}.system{border-color:#a1a1aa}.user{border-color:#2563eb}
.assistant{border-color:#16a34a}.tool{border-color:#ea580c}.call{font-family:monospace;
background:#fff7ed;padding:.2em .4em;margin:.2em 0}.error{color:#b91c1c}
.explanation{background:#f4f4f5;padding:.5em .8em;border-radius:6px}
figure{display:inline-block;margin:1em 1em 1em 0}
"""


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def _u(value) -> str:
    """An id as one URL path segment: ids are any printable text ("task 17/attempt 3")."""
    return quote(str(value), safe="")


def _num(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _time(value) -> str:
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return _e(value)


def _page(request: web.Request, title: str, body: str) -> web.Response:
    text = f"""<!doctype html><html><head><meta charset="utf-8"><title>{_e(title)} - overnight</title>
<style>{STYLE}</style></head><body><header><strong>overnight</strong> &nbsp;
<a href="/ui">groups</a><a href="/ui/adapters">adapters</a><a href="/ui/runs">training runs</a>
</header><main><h1>{_e(title)}</h1>{body}</main></body></html>"""
    # `/ui?token=...` once: the proxy's middleware answers it with the COOKIE, a session id.
    return web.Response(text=text, content_type="text/html")


def _table(headers: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{cell}</td>' if i in numeric else f"<td>{cell}</td>"
            for i, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


async def _query(request: web.Request, render):
    """Run `render(con)` on a fresh DuckDB over the data directory, off the loop."""
    data_dir = request.config_dict[DATA_DIR]

    def work():
        con = open_db(data_dir)
        try:
            return render(con)
        finally:
            con.close()

    return await asyncio.to_thread(work)


# -- groups ---------------------------------------------------------------------------

STATUSES = {
    "all": "TRUE",
    "finished": "finished = rollouts",
    "open": "finished < rollouts",
    "scored": "rewarded > 0",
    "unscored": "rewarded = 0",
}


class BadFilter(OvernightError):
    status = 400
    code = "invalid_filter"


def _float_param(request: web.Request, name: str) -> float | None:
    raw = request.query.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise BadFilter(f"{name} must be a number, got {raw!r}") from None


@dataclass(frozen=True)
class GroupFilters:
    """The groups page's query parameters, checked, and the SQL they make."""

    search: str
    adapter: str
    status: str
    limit: int
    where: list[str]
    args: list


def _group_filters(request: web.Request) -> GroupFilters:
    search = request.query.get("q", "").strip()
    adapter = request.query.get("adapter", "").strip()
    status = request.query.get("status", "all")
    if status not in STATUSES:
        raise BadFilter(f"status must be one of {', '.join(STATUSES)}")
    low, high = _float_param(request, "min_reward"), _float_param(request, "max_reward")
    try:
        limit = min(max(int(request.query.get("limit", "100")), 1), 1000)
    except ValueError:
        raise BadFilter("limit must be a whole number") from None
    where, args = [STATUSES[status]], []
    if search:
        where.append("contains(group_id, ?)")
        args.append(search)
    if adapter:
        where.append("contains(models_served, ?)")
        args.append(adapter)
    if low is not None:
        where.append("mean_reward >= ?")
        args.append(low)
    if high is not None:
        where.append("mean_reward <= ?")
        args.append(high)
    return GroupFilters(search, adapter, status, limit, where, args)


def _filter_form(request: web.Request, f: GroupFilters, adapters: list[str]) -> str:
    options = "".join(
        f'<option value="{_e(s)}"{" selected" if s == f.status else ""}>{_e(s)}</option>'
        for s in STATUSES
    )
    adapter_options = '<option value="">any</option>' + "".join(
        f'<option value="{_e(a)}"{" selected" if a == f.adapter else ""}>{_e(a)}</option>'
        for a in adapters
    )
    return f"""<form class="filters" method="get" action="/ui">
<label>group id contains<input name="q" value="{_e(f.search)}"></label>
<label>served by<select name="adapter">{adapter_options}</select></label>
<label>status<select name="status">{options}</select></label>
<label>mean reward from<input name="min_reward" size="5" value="{_e(request.query.get("min_reward", ""))}"></label>
<label>to<input name="max_reward" size="5" value="{_e(request.query.get("max_reward", ""))}"></label>
<label>at most<input name="limit" size="5" value="{f.limit}"></label>
<button type="submit">filter</button> <a href="/ui">clear</a></form>"""


async def groups_page(request: web.Request) -> web.Response:
    f = _group_filters(request)

    def render(con):
        # Counted on the turns (one pass for both), newest first from the last days
        # back (newest_groups): neither aggregates every group of the history.
        total, served = con.execute(
            "SELECT count(DISTINCT group_id), list(DISTINCT model_served) FROM completions"
        ).fetchone()
        columns = (
            "group_id, rollouts, finished, rewarded, mean_reward, turns, tokens, "
            "models_served, started_at"
        )
        rows = newest_groups(con, columns, "started_at", f.limit, f.where, f.args)
        return total, rows, sorted(m for m in served or [] if m)

    total, rows, adapters = await _query(request, render)
    table = _table(
        [
            "group",
            "rollouts",
            "finished",
            "scored",
            "mean reward",
            "turns",
            "tokens",
            "served by",
            "started",
        ],
        [
            [
                f'<a href="/ui/groups/{_u(g)}">{_e(g)}</a>',
                _num(n),
                _num(fin),
                _num(scored),
                _num(reward),
                _num(turns),
                _num(tokens),
                _e(served),
                _time(started),
            ]
            for g, n, fin, scored, reward, turns, tokens, served, started in rows
        ],
        numeric={1, 2, 3, 4, 5, 6},
    )
    summary = f'<p class="meta" id="count">{len(rows)} of {total} group(s) shown</p>'
    body = _uncaptured_html(request) + _filter_form(request, f, adapters) + summary + table
    return _page(request, "Groups", body)


def _uncaptured_html(request: web.Request) -> str:
    """A warning, above the groups, naming the paths whose model output was not recorded."""
    counts = request.config_dict.get(UNCAPTURED)
    counts = counts() if counts is not None else {}
    if not counts:
        return ""
    items = ", ".join(f"<code>/v1/{_e(p)}</code> ({n})" for p, n in sorted(counts.items()))
    return (
        f'<p class="error" id="uncaptured">Not recorded: model output on {items}. '
        "These requests were forwarded but the proxy does not capture their path.</p>"
    )


# -- one group, one rollout ---------------------------------------------------------


async def group_page(request: web.Request) -> web.Response:
    group = request.match_info["group"]

    def render(con):
        return con.execute(
            "SELECT rollout_id, turns, prompt_tokens + completion_tokens, reward, reward_source, "
            "judge_score, judge_explanation, finished_at, models_served, errors "
            "FROM rollouts WHERE group_id = ? ORDER BY reward DESC NULLS LAST, rollout_id",
            [group],
        ).fetchall()

    rows = await _query(request, render)
    if not rows:
        raise OvernightError(f"no group {group!r}", status=404, code="not_found")
    table = _table(
        [
            "rollout",
            "turns",
            "tokens",
            "reward",
            "source",
            "judge score",
            "judge's explanation",
            "finished",
            "served by",
            "errors",
        ],
        [
            [
                f'<a href="/ui/rollouts/{_u(r)}">{_e(r)}</a>',
                _num(turns),
                _num(tokens),
                _num(reward),
                _e(source or "-"),
                _num(score),
                _e(explanation or ""),
                "yes" if finished else "no",
                _e(served),
                _num(errors),
            ]
            for r, turns, tokens, reward, source, score, explanation, finished, served, errors in rows
        ],
        numeric={1, 2, 3, 5, 9},
    )
    return _page(request, f"Group {group}", table)


def _message_html(message: dict) -> str:
    role, text, calls = message_parts(message)
    parts = [f'<div class="msg {_e(role)}"><strong>{_e(role)}</strong> {_e(text)}']
    parts += [f'<div class="call">&rarr; {_e(name)}({_e(args)})</div>' for name, args in calls]
    return "".join(parts) + "</div>"


async def rollout_page(request: web.Request) -> web.Response:
    r = await _query(request, lambda con: load_rollout(con, request.match_info["rollout"]))
    head = [
        f'<p>group <a href="/ui/groups/{_u(r.group_id)}">{_e(r.group_id)}</a> &middot; '
        f'{len(r.turns)} turn(s) &middot; reward <strong id="reward">{_num(r.reward)}</strong>'
        f" ({_e(r.reward_source or 'none')}) &middot; "
        f"{'finished' if r.finished else 'not finished'}</p>"
    ]
    if r.judge_score is not None:
        head.append(
            f'<div class="explanation" id="judge"><strong>judge {_e(r.judge_model)}: '
            f"{_num(r.judge_score)}</strong><br>{_e(r.judge_explanation)}</div>"
        )
    body = []
    for t in r.turns:
        parts = [_message_html(m) for m in t.messages]
        if t.error:
            parts.append(f'<div class="error">error: {_e(t.error)}</div>')
        body.append(
            f'<section class="turn"><div class="meta">turn {t.index} &middot; '
            f"{_time(t.started_at)} &middot; served by {_e(t.served_by)} &middot; {t.tokens} "
            f"tokens &middot; {t.latency_ms:.0f} ms &middot; finish {_e(t.finish_reason)}</div>"
            f"{''.join(parts)}</section>"
        )
    return _page(request, f"Rollout {r.rollout_id}", "".join(head) + "".join(body))


# -- adapters and runs ----------------------------------------------------------------


async def adapters_page(request: web.Request) -> web.Response:
    state = request.config_dict[ADAPTER_STATE]()

    def render(con):
        return con.execute(
            "SELECT model_served, count(*), min(started_at), max(started_at), "
            "avg(r.reward) FROM completions c LEFT JOIN rollout_rewards r USING (rollout_id) "
            "GROUP BY model_served ORDER BY min(started_at)"
        ).fetchall()

    served = await _query(request, render)
    current = state.get("current") or {}
    stack = set(state.get("stack") or [])
    history = _table(
        ["version", "name", "how", "at", "path", "on the stack"],
        [
            [
                _num(a["version"]),
                _e(a["name"]),
                _e(a["reason"]),
                _e(a["promoted_at"]),
                _e(a["path"]),
                "yes" if a["name"] in stack else "",
            ]
            for a in reversed(state.get("adapters") or [])
        ],
        numeric={0},
    )
    # Rollbacks (with the watch's or the operator's reason) and canary decisions.
    events = _table(
        ["at", "what", "adapter", "then served", "why"],
        [
            [_e(v.get("at")), _e(v.get("action")), _e(v.get("adapter")),
             _e(v.get("serves") or "the base model"), _e(v.get("reason") or "-")]
            for v in reversed(state.get("events") or [])
        ],
    )  # fmt: skip
    canary = state.get("canary")
    canary_line = (
        f'<p id="canary">canary: <strong>{_e(canary["name"])}</strong> serves '
        f"{canary['fraction']:.0%} of the alias's rollouts</p>"
        if canary
        else ""
    )
    usage = _table(
        ["served by", "completions", "first", "last", "mean reward"],
        [[_e(m), _num(n), _time(a), _time(b), _num(r)] for m, n, a, b, r in served],
        numeric={1, 4},
    )
    body = (
        f"<p>alias <strong>{_e(state.get('alias'))}</strong> now serves "
        f'<strong id="current">{_e(current.get("name") or "the base model")}</strong>'
        f" (base model {_e(state.get('base_model'))})</p>{canary_line}"
        f"<h2>Promotions and rollbacks, newest first</h2>{history}"
        f"<h2>Why it changed, newest first</h2>{events}"
        f"<h2>When each served</h2>{usage}"
    )
    return _page(request, "Adapters", body)


async def runs_page(request: web.Request) -> web.Response:
    def render(con):
        runs = con.execute(
            "SELECT run_id, started_at, status, len(groups), rollouts, steps, trained_tokens, "
            "reward_mean, promoted_as, max_logprob_gap, error, "
            "json_extract_string(metrics, '$.gate.verdict'), "
            "json_extract_string(metrics, '$.gate.reason') FROM training_runs "
            "ORDER BY started_at DESC"
        ).fetchall()
        return runs, training_charts(con)

    runs, charts = await _query(request, render)
    table = _table(
        [
            "run",
            "started",
            "status",
            "groups",
            "rollouts",
            "steps",
            "tokens",
            "reward mean",
            "promoted as",
            "logprob gap",
            "error",
            "gate",
        ],
        [
            [
                _e(r[0]),
                _time(r[1]),
                _e(r[2]),
                *(_num(v) for v in r[3:8]),
                _e(r[8] or "-"),
                f"{r[9]:.1e}" if r[9] is not None else "-",
                _e(r[10] or ""),
                f'<span title="{_e(r[12] or "")}">{_e(r[11] or "-")}</span>',
            ]
            for r in runs
        ],
        numeric={3, 4, 5, 6, 7, 9},
    )
    return _page(request, "Training runs", "".join(charts) + table)


# -- the sub-application --------------------------------------------------------------


def create_web_view() -> web.Application:
    """The view's pages, for `app.add_subapp("/ui", ...)`: "" is /ui itself."""
    view = web.Application()
    view.router.add_get("", groups_page)
    view.router.add_get("/groups/{group}", group_page)
    view.router.add_get("/rollouts/{rollout}", rollout_page)
    view.router.add_get("/adapters", adapters_page)
    view.router.add_get("/runs", runs_page)
    return view
