"""Which policy a page of the web view shows: `?policy=NAME`, checked against the proxy's
policies, and the switcher that links to each.

A policy's groups are those whose first turn asked for its alias (storage/read/policy_scope.py,
the definition the nights train by). The name comes from the browser: one the proxy does
not serve is refused (404) before it reaches a query, and the answer does not repeat it;
the names a page shows and links to are the configured ones, escaped all the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

from aiohttp import web

from overnight.errors import OvernightError
from overnight.storage.read.policy_scope import PolicyScope

from .data import ADAPTER_STATE
from .frame import esc


@dataclass(frozen=True)
class Chosen:
    """The policy a page shows (None: every policy's), and the proxy's policies."""

    name: str | None
    names: tuple[str, ...]
    state: dict  # the registry's describe(): what PolicyScope.of reads
    scope: PolicyScope | None

    def query(self, first: str = "?") -> str:
        """`?policy=NAME` for the links of a page of one policy ("" for all)."""
        return "" if self.name is None else f"{first}policy={quote(self.name, safe='')}"


def chosen_policy(request: web.Request) -> Chosen:
    """The page's `?policy=`, one of the proxy's policies; absent or empty: none chosen."""
    state = request.config_dict[ADAPTER_STATE]()
    names = tuple(state.get("policies") or ())
    name = request.query.get("policy") or None
    if name is not None and name not in names:
        raise OvernightError(
            f"no such policy here; this proxy serves {', '.join(names) or 'none'}",
            status=404,
            code="not_found",
        )
    return Chosen(name, names, state, PolicyScope.of(name, state))


def is_policys(con, scope: PolicyScope | None, group_id: str) -> bool:
    """Whether `group_id` is one of `scope`'s groups (None: every policy's), by the SQL the
    groups page filters with."""
    if scope is None:
        return True
    condition, params = scope.group_condition()
    found = con.execute(
        f"SELECT count(*) FROM (SELECT ?::VARCHAR AS group_id) WHERE {condition}",
        [group_id, *params],
    ).fetchone()
    return found[0] > 0


def owner(con, chosen: Chosen, group_id: str) -> str | None:
    """The policy whose group `group_id` is, of the proxy's; None for none of them."""
    for name in chosen.names:
        if is_policys(con, PolicyScope.of(name, chosen.state), group_id):
            return name
    return None


def policy_links(
    page: str, names: list[str] | tuple[str, ...], shown: str | None, every: bool = False
) -> str:
    """Links to the page of each policy (none with one policy: nothing to choose);
    `every`: also to the page of all of them, where a page has one (`shown` None)."""
    if len(names) < 2:
        return ""
    links = [
        f"<strong>{esc(n)}</strong>" if n == shown
        else f'<a href="{esc(page)}?policy={esc(quote(n, safe=""))}">{esc(n)}</a>'
        for n in names
    ]  # fmt: skip
    if every:
        links.insert(
            0, "<strong>all</strong>" if shown is None else f'<a href="{esc(page)}">all</a>'
        )
    return f'<p class="policies" id="policies">policies: {" | ".join(links)}</p>'
