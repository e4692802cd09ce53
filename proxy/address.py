"""Where a running proxy can be found: DATA/proxy.json, written at start, gone at exit.

`overnight train` and `overnight rollback` promote and roll back through the proxy
serving the data directory they are given; without `--proxy` they read this file
(its URL, pid, host, and whether the admin API wants a token: never the token). The
file is owner-only, replaced atomically, and removed on a clean exit by the process
that wrote it; one left by a killed proxy names a pid that is gone (or another
machine), and is ignored. With several proxies on one directory the last to start
is the one named.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from pathlib import Path

from aiohttp import web

from .alias.state_file import pid_alive
from .state import CONFIG

log = logging.getLogger("overnight.proxy")

ADDRESS_FILE = "proxy.json"


def proxy_url(host: str, port: int) -> str:
    """The URL a local client uses for a proxy bound to `host`."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def write_address(data_dir: Path, url: str, admin_token_required: bool) -> Path:
    path = Path(data_dir) / ADDRESS_FILE
    record = {
        "url": url,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "admin_token_required": admin_token_required,
    }
    tmp = path.with_name(f".{ADDRESS_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)
    return path


def remove_address(data_dir: Path) -> None:
    """Remove the file if this process wrote it (another proxy may have replaced it)."""
    path = Path(data_dir) / ADDRESS_FILE
    record = _read(path)
    if record is not None and record.get("pid") == os.getpid():
        path.unlink(missing_ok=True)


def find_proxy(data_dir: Path) -> dict | None:
    """The live proxy's record ({"url", "pid", "host", "admin_token_required"}), or None
    when there is no file, it is unreadable, or its process is gone."""
    record = _read(Path(data_dir) / ADDRESS_FILE)
    if record is None or not isinstance(record.get("url"), str):
        return None
    if record.get("host") != socket.gethostname() or not pid_alive(record.get("pid")):
        return None
    return record


def advertise(app: web.Application, data_dir: Path, url: str, admin_token_required: bool) -> None:
    """Write the address once the app has started, remove it when it cleans up."""
    data_dir = app[CONFIG].data_dir  # the app's local directory (also when --data is a URL)

    async def write(_app: web.Application) -> None:
        try:
            write_address(data_dir, url, admin_token_required)
        except OSError as e:  # serving matters more than being found
            log.warning("could not write %s: %s", Path(data_dir) / ADDRESS_FILE, e)

    async def remove(_app: web.Application) -> None:
        remove_address(data_dir)

    app.on_startup.append(write)
    app.on_cleanup.append(remove)


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
