"""The HTML the web view's pages are made of: the frame and its style, tables, escaping.

Every value a page shows passes through `esc`: ids, messages and judge explanations are
whatever agents and models wrote, and unescaped one could be markup, or script in the
operator's browser. Every id in a link passes through `url_segment`.
"""

from __future__ import annotations

import datetime as dt
import html
from urllib.parse import quote

from aiohttp import web

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
.signal{color:#1d4ed8;font-size:.9em}
figure{display:inline-block;margin:1em 1em 1em 0}
"""


def esc(value) -> str:
    return html.escape("" if value is None else str(value))


def url_segment(value) -> str:
    """An id as one URL path segment: ids are any printable text ("task 17/attempt 3")."""
    return quote(str(value), safe="")


def num(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def stamp(value) -> str:
    if isinstance(value, dt.datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return esc(value)


def html_page(
    request: web.Request, title: str, body: str, policy: str | None = None
) -> web.Response:
    """A page; `policy` (one of the proxy's, checked): the header's links stay on it."""
    q = "" if policy is None else f"?policy={esc(quote(policy, safe=''))}"
    shown = "" if policy is None else f" &middot; policy <strong>{esc(policy)}</strong>"
    text = f"""<!doctype html><html><head><meta charset="utf-8"><title>{esc(title)} - overnight</title>
<style>{STYLE}</style></head><body><header><strong>overnight</strong>{shown} &nbsp;
<a href="/ui{q}">groups</a><a href="/ui/adapters{q}">adapters</a><a href="/ui/runs{q}">training runs</a>
</header><main><h1>{esc(title)}</h1>{body}</main></body></html>"""
    # `/ui?token=...` once: the proxy's middleware answers it with the COOKIE, a session id.
    return web.Response(text=text, content_type="text/html")


def html_table(headers: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
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
