"""Whose traffic the groups page shows: `?sent_by=`, the agents' by default, and the
switcher that links to overnight's own (storage/read/sent_by.py: what each kind is).

`client` (absent: the default) shows the groups any agent's turn is in; `own` the groups
overnight sent itself (the demo's held-out measurement, a judge served by the same vLLM,
...); one kind, only its groups; `all`, every group. Anything else is refused (400)
before it reaches a query.
"""

from __future__ import annotations

from urllib.parse import quote

from aiohttp import web

from overnight.errors import OvernightError
from overnight.storage.read.sent_by import AGGREGATE_SENT_BY, CLIENT, shown

from .frame import esc

# The switcher's choices, in its order, and how each is named on the page.
CHOICES = {CLIENT: "agents", "own": "overnight's own", "all": "all"}


def chosen_senders(request: web.Request) -> tuple[str, str, list]:
    """The page's `?sent_by=` (absent or empty: `client`), and its SQL condition on the
    `groups` view with the condition's parameters; 400 for a value it does not know."""
    which = request.query.get("sent_by") or CLIENT
    try:
        condition, args = shown("sent_by", which)
    except ValueError as e:
        raise OvernightError(str(e), status=400, code="invalid_filter") from None
    return which, condition, args


def group_counts(con, mine: str, mine_args: list) -> dict[str, int]:
    """Groups by who sent them (`client`, each kind of overnight's own), of those `mine`
    (a condition on the `completions` view) holds: the switcher's counts. One pass over
    the turns, as the page's total is counted, not over the `groups` view."""
    rows = con.execute(
        f"SELECT sent_by, count(*) FROM (SELECT {AGGREGATE_SENT_BY.format(column='sent_by')} "
        f"AS sent_by FROM completions WHERE {mine} GROUP BY group_id) GROUP BY sent_by",
        mine_args,
    ).fetchall()
    return dict(rows)


def count_of(counts: dict[str, int], which: str) -> int:
    """Of the groups counted by who sent them (`group_counts`), those `which` shows."""
    if which == "all":
        return sum(counts.values())
    if which == "own":
        return sum(n for kind, n in counts.items() if kind != CLIENT)
    return counts.get(which, 0)


def sender_links(which: str, counts: dict[str, int], policy_query: str) -> str:
    """Links to the agents' groups, overnight's own and all of them, with their counts;
    the one shown in bold. `policy_query`: `&policy=NAME`, kept by every link."""
    numbers = {choice: count_of(counts, choice) for choice in CHOICES}
    links = []
    for choice, label in CHOICES.items():
        text = f"{esc(label)} ({numbers[choice]})"
        if choice == which:
            links.append(f"<strong>{text}</strong>")
        else:
            href = f"/ui?sent_by={quote(choice, safe='')}{policy_query}"
            links.append(f'<a href="{esc(href)}">{text}</a>')
    if which not in CHOICES:  # one kind of overnight's own, chosen by its link
        links.append(f"<strong>{esc(which)} ({count_of(counts, which)})</strong>")
    return f'<p class="senders" id="senders">sent by: {" | ".join(links)}</p>'
