"""The read-only web view at /ui: server-rendered pages over the data directory.

    /ui                       groups, newest first, with filters (query parameters)
    /ui/groups/{group}        a group's rollouts: reward, judge score and explanation
    /ui/rollouts/{rollout}    one conversation turn by turn, tool calls included
    /ui/adapters              adapter versions: the promotion stack, and when each served
    /ui/runs                  training runs, with reward and loss curves
    /ui/images/{sha256}       a stored image of a request (images.py)

Every page takes `?policy=NAME`, one of the proxy's policies (policies.py): that policy's
groups, adapters and runs, and links that keep to it.

Plain HTML and inline SVG, no script and nothing fetched from elsewhere (a request's
images come from /ui/images): it works on a machine with no network, and a filter is a link that can be shared. Each page opens its own DuckDB
over the Parquet segments and live logs (as `overnight ls` does), in a worker thread
so the event loop keeps forwarding traffic.

An aiohttp sub-application (`create_web_view`), mounted at /ui by the proxy. Access is
the admin API's, checked by the proxy's middleware: the admin token (as a bearer token,
or once as `?token=`, which the middleware answers with a random session id in the
`COOKIE`), else loopback clients only.

The pages live in groups.py (the traffic) and training.py (adapters, runs); they stand on
frame.py (the page frame, tables, escaping), data.py (the keys the mounter sets, the
query off the loop) and policies.py (which policy a page shows).
"""

from __future__ import annotations

from aiohttp import web

from .data import ADAPTER_STATE, DATA_DIR, UNCAPTURED
from .groups import group_page, groups_page, rollout_page
from .images import image
from .training import adapters_page, runs_page

# The keys live below the pages that read them (data.py); the mounter imports them
# from here, with the COOKIE and the app itself.
__all__ = ["ADAPTER_STATE", "COOKIE", "DATA_DIR", "UNCAPTURED", "create_web_view"]

COOKIE = "overnight_ui"  # a session id the proxy's middleware issues and checks


def create_web_view() -> web.Application:
    """The view's pages, for `app.add_subapp("/ui", ...)`: "" is /ui itself."""
    view = web.Application()
    view.router.add_get("", groups_page)
    view.router.add_get("/groups/{group}", group_page)
    view.router.add_get("/rollouts/{rollout}", rollout_page)
    view.router.add_get("/adapters", adapters_page)
    view.router.add_get("/runs", runs_page)
    view.router.add_get("/images/{digest}", image)
    return view
