"""What the web view's pages read, and how: the keys its mounter sets, and a query off the loop.

Each page opens its own DuckDB over the Parquet segments and live logs (as `overnight
ls` does), in a worker thread so the event loop keeps forwarding traffic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import duckdb
from aiohttp import web

from overnight.storage import open_db
from overnight.storage.read.reader import read_failure

# What the view reads, through `request.config_dict`: set on the parent app by whoever
# mounts the view (the proxy's create_app). The keys live here, not in the proxy: view/
# imports neither the proxy, the judge nor the trainer, so the proxy imports them from
# the layer below and nothing imports the app module back (no import cycle).
DATA_DIR = web.AppKey("data_dir", Path)
# A policy's registry `describe(policy)` (None: the default policy's): alias, current
# adapter, promotion history, and `policies`, every policy's name.
ADAPTER_STATE = web.AppKey[Callable[..., dict]]("adapter_state")
# POSTs that produced model output on paths the proxy forwards but does not record:
# path -> count, since the proxy started. Optional: a view mounted without it shows none.
UNCAPTURED = web.AppKey[Callable[[], dict[str, int]]]("uncaptured")


async def query(request: web.Request, render):
    """Run `render(con)` on a fresh DuckDB over the data directory, off the loop; a query
    that fails in a damaged file answers 500 naming it (`read_failure`)."""
    data_dir = request.config_dict[DATA_DIR]

    def work():
        con = open_db(data_dir)
        try:
            return render(con)
        except duckdb.Error as e:
            raise web.HTTPInternalServerError(text=read_failure(data_dir, e)) from e
        finally:
            con.close()

    return await asyncio.to_thread(work)
