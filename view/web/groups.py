"""The web view's pages over the recorded traffic: the groups, one group, one rollout.

    /ui                       groups, newest first, with filters (query parameters)
    /ui/groups/{group}        a group's rollouts: reward, judge score and explanation
    /ui/rollouts/{rollout}    one conversation turn by turn, tool calls included

By default the page shows the agents' groups; `?sent_by=` (senders.py) shows overnight's
own (`own`, or one kind) or all of them, one link away. A filter is a link that can be shared: the groups page's filters are its query
parameters, checked (`BadFilter`, a 400) before they become SQL parameters. Each page
takes `?policy=NAME` (policies.py): the groups whose first turn asked for that policy,
as its nights choose them (storage/read/policy_scope.py); its links keep the policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from overnight.errors import OvernightError
from overnight.storage.read.images import image_parts
from overnight.view.display import load_rollout, message_parts, newest_groups, signal_line

from .data import UNCAPTURED, query
from .frame import esc, html_page, html_table, num, stamp, url_segment
from .policies import Chosen, chosen_policy, is_policys, owner, policy_links
from .senders import chosen_senders, count_of, group_counts, sender_links

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


def _filter_form(
    request: web.Request, f: GroupFilters, adapters: list[str], chosen: Chosen, senders: str
) -> str:
    options = "".join(
        f'<option value="{esc(s)}"{" selected" if s == f.status else ""}>{esc(s)}</option>'
        for s in STATUSES
    )
    adapter_options = '<option value="">any</option>' + "".join(
        f'<option value="{esc(a)}"{" selected" if a == f.adapter else ""}>{esc(a)}</option>'
        for a in adapters
    )
    # The policy rides along as a hidden field: filtering stays within it.
    policy = (
        f'<input type="hidden" name="policy" value="{esc(chosen.name)}">' if chosen.name else ""
    )  # and whose traffic, as the switcher above the form chose it
    policy += f'<input type="hidden" name="sent_by" value="{esc(senders)}">'
    return f"""<form class="filters" method="get" action="/ui">{policy}
<label>group id contains<input name="q" value="{esc(f.search)}"></label>
<label>served by<select name="adapter">{adapter_options}</select></label>
<label>status<select name="status">{options}</select></label>
<label>mean reward from<input name="min_reward" size="5" value="{esc(request.query.get("min_reward", ""))}"></label>
<label>to<input name="max_reward" size="5" value="{esc(request.query.get("max_reward", ""))}"></label>
<label>at most<input name="limit" size="5" value="{f.limit}"></label>
<button type="submit">filter</button> <a href="/ui{esc(chosen.query())}">clear</a></form>"""


async def groups_page(request: web.Request) -> web.Response:
    f = _group_filters(request)
    chosen = chosen_policy(request)  # an unknown one: 404
    mine, mine_args = chosen.scope.group_condition() if chosen.scope else ("TRUE", [])
    senders, sent, sent_args = chosen_senders(request)  # an unknown one: 400

    def render(con):
        # Counted on the turns, newest first from the last days back (newest_groups):
        # neither aggregates every group of the history (but a policy's: which groups
        # are its is decided by each one's first turn).
        (served,) = con.execute(
            f"SELECT list(DISTINCT model_served) FROM completions WHERE {mine}", mine_args
        ).fetchone()
        counts = group_counts(con, mine, mine_args)
        columns = (
            "group_id, rollouts, finished, rewarded, mean_reward, turns, tokens, "
            "models_served, started_at"
        )
        where, args = [*f.where, mine, sent], [*f.args, *mine_args, *sent_args]
        rows = newest_groups(con, columns, "started_at", f.limit, where, args)
        return counts, rows, sorted(m for m in served or [] if m)

    counts, rows, adapters = await query(request, render)
    total = count_of(counts, senders)
    table = html_table(
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
                f'<a href="/ui/groups/{url_segment(g)}{esc(chosen.query())}">{esc(g)}</a>',
                num(n),
                num(fin),
                num(scored),
                num(reward),
                num(turns),
                num(tokens),
                esc(served),
                stamp(started),
            ]
            for g, n, fin, scored, reward, turns, tokens, served, started in rows
        ],
        numeric={1, 2, 3, 4, 5, 6},
    )
    summary = f'<p class="meta" id="count">{len(rows)} of {total} group(s) shown</p>'
    links = policy_links("/ui", chosen.names, chosen.name, every=True)
    links += sender_links(senders, counts, chosen.query("&"))
    form = _filter_form(request, f, adapters, chosen, senders)
    body = _uncaptured_html(request) + links + form + summary + table
    return html_page(request, "Groups", body, chosen.name)


def _uncaptured_html(request: web.Request) -> str:
    """A warning, above the groups, naming the paths whose model output was not recorded."""
    counts = request.config_dict.get(UNCAPTURED)
    counts = counts() if counts is not None else {}
    if not counts:
        return ""
    items = ", ".join(f"<code>/v1/{esc(p)}</code> ({n})" for p, n in sorted(counts.items()))
    return (
        f'<p class="error" id="uncaptured">Not recorded: model output on {items}. '
        "These requests were forwarded but the proxy does not capture their path.</p>"
    )


# -- one group, one rollout ---------------------------------------------------------


async def group_page(request: web.Request) -> web.Response:
    group = request.match_info["group"]
    chosen = chosen_policy(request)  # an unknown one: 404
    mine, mine_args = chosen.scope.group_condition() if chosen.scope else ("TRUE", [])

    def render(con):
        rows = con.execute(
            "SELECT rollout_id, turns, prompt_tokens + completion_tokens, reward, reward_source, "
            "judge_score, judge_explanation, finished_at, models_served, errors "
            f"FROM rollouts WHERE group_id = ? AND {mine} "
            "ORDER BY reward DESC NULLS LAST, rollout_id",
            [group, *mine_args],
        ).fetchall()
        return rows, owner(con, chosen, group) if rows and len(chosen.names) > 1 else None

    rows, policy = await query(request, render)
    if not rows:
        of = f" of the policy {chosen.name}" if chosen.name else ""
        raise OvernightError(f"no group {group!r}{of}", status=404, code="not_found")
    table = html_table(
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
                f'<a href="/ui/rollouts/{url_segment(r)}{esc(chosen.query())}">{esc(r)}</a>',
                num(turns),
                num(tokens),
                num(reward),
                esc(source or "-"),
                num(score),
                esc(explanation or ""),
                "yes" if finished else "no",
                esc(served),
                num(errors),
            ]
            for r, turns, tokens, reward, source, score, explanation, finished, served, errors in rows
        ],
        numeric={1, 2, 3, 5, 9},
    )
    # Whose it is, with several policies: a link to that policy's groups.
    line = (
        f'<p id="policy">policy <a href="/ui?policy={url_segment(policy)}">{esc(policy)}</a></p>'
        if policy is not None
        else ""
    )
    return html_page(request, f"Group {group}", line + table, chosen.name)


def _message_html(message: dict) -> str:
    role, text, calls = message_parts(message)
    parts = [f'<div class="msg {esc(role)}"><strong>{esc(role)}</strong> {esc(text)}']
    # A stored image is shown from the store (images.py); an inline or linked one is not
    # fetched (its label says what it is).
    parts += [
        f'<div class="image"><img src="/ui/images/{i.digest}" alt="{esc(i.media_type)}"'
        ' style="max-width:100%"></div>'
        for i in image_parts(message)
        if i is not None and i.kind == "stored"
    ]
    parts += [f'<div class="call">&rarr; {esc(name)}({esc(args)})</div>' for name, args in calls]
    return "".join(parts) + "</div>"


async def rollout_page(request: web.Request) -> web.Response:
    chosen = chosen_policy(request)  # an unknown one: 404
    rollout_id = request.match_info["rollout"]

    def render(con):
        r = load_rollout(con, rollout_id)
        if not is_policys(con, chosen.scope, r.group_id):
            raise OvernightError(
                f"no rollout {rollout_id!r} of the policy {chosen.name}",
                status=404,
                code="not_found",
            )
        return r

    r = await query(request, render)
    group_link = f"/ui/groups/{url_segment(r.group_id)}{chosen.query()}"
    head = [
        f'<p>group <a href="{esc(group_link)}">{esc(r.group_id)}</a> &middot; '
        f'{len(r.turns)} turn(s) &middot; reward <strong id="reward">{num(r.reward)}</strong>'
        f" ({esc(r.reward_source or 'none')}) &middot; "
        f"{'finished' if r.finished else 'not finished'}</p>"
    ]
    if r.judge_score is not None:
        head.append(
            f'<div class="explanation" id="judge"><strong>judge {esc(r.judge_model)}: '
            f"{num(r.judge_score)}</strong><br>{esc(r.judge_explanation)}</div>"
        )
    body = []
    for t in r.turns:
        parts = [_message_html(m) for m in t.messages]
        if t.error:
            parts.append(f'<div class="error">error: {esc(t.error)}</div>')
        parts += [f'<div class="signal">next: {esc(signal_line(s))}</div>' for s in t.signals]
        body.append(
            f'<section class="turn"><div class="meta">turn {t.index} &middot; '
            f"{stamp(t.started_at)} &middot; served by {esc(t.served_by)} &middot; {t.tokens} "
            f"tokens &middot; {t.latency_ms:.0f} ms &middot; finish {esc(t.finish_reason)}</div>"
            f"{''.join(parts)}</section>"
        )
    return html_page(request, f"Rollout {r.rollout_id}", "".join(head) + "".join(body), chosen.name)
