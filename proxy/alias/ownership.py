"""Which adapters are a policy's own: what a per-policy admin token may promote.

A per-policy admin token (the keys file's `[[admin]]`; routes/auth.py) promotes and
rolls back its own policy only. Left at that, it could still name any path as the
adapter to promote: another policy's night, a directory anywhere on the machine, any
upload in the bucket. So such a promotion must name one of its policy's own adapters:

  one its promotion state names already (a rollback target, the canary: its path or
  its upload), whoever promoted it there;
  a night's adapter, DATA/adapters/<run>, whose run (DATA/runs/<run>/run.json, written
  by the night before it trains: trainer/run/checkpoint.py) trained this policy; a run
  that names none trained the default policy (runs from before policies);
  with a bucket, an upload of this data directory's (`<bucket>/adapters/<key>`) whose
  manifest names this policy (the night publishes it so: trainer/serving/proxy_client.py;
  one that names none is the default policy's, as uploads from before policies).

A local path is judged where it leads: absolute, without `..`, symlinks resolved, and
what is promoted is that resolved path, so the directory checked is the one loaded.
Everything else is refused (403) before anything is loaded, uploaded or written. The
operator's admin token is not checked here: it may promote any directory.
"""

from __future__ import annotations

from pathlib import Path

from overnight.errors import OvernightError
from overnight.storage import data_url, segment_store
from overnight.storage.bucket import adapter_sync

from .promotions import Adapter
from .retention import ADAPTERS_DIR, night_run


class NotOwnAdapter(OvernightError):
    status = 403
    code = "admin_forbidden"


def own_adapter(
    path: str, policy: str, default: str, data_dir: Path, history: list[Adapter]
) -> str:
    """`path` (or, for a local one, where it resolves to) when it is one of `policy`'s own
    adapters; NotOwnAdapter otherwise. `history`: the adapters its state names. Blocking
    (a bucket's manifest is read): call it off the event loop."""
    if "\x00" in path:
        raise _refused(path, policy, "it is not a path")
    if path in {where for a in history for where in (a.path, a.source) if where}:
        return path
    if data_url(path) is not None:
        return _own_upload(path, policy, default, data_dir)
    return _own_night(path, policy, default, data_dir)


def _own_upload(source: str, policy: str, default: str, data_dir: Path) -> str:
    store = segment_store(data_dir)
    if store.url is None:
        raise _refused(source, policy, "this proxy's adapters are not in a bucket")
    try:
        named = adapter_sync.upload_policy(store, source)
    except adapter_sync.AdapterSyncError as e:
        raise _refused(source, policy, str(e)) from e
    if (named or default) != policy:
        raise _refused(source, policy, "its upload was not trained for this policy")
    return source


def _own_night(path: str, policy: str, default: str, data_dir: Path) -> str:
    given = Path(path)
    if not given.is_absolute() or ".." in given.parts:
        raise _refused(path, policy, "give the adapter's absolute path, without `..`")
    resolved = given.resolve()
    nights = (Path(data_dir) / ADAPTERS_DIR).resolve()
    if resolved.parent != nights:
        raise _refused(path, policy, f"it is not a night's adapter in {nights}")
    # One answer for no run and another policy's run: a refusal must not tell a token
    # which runs the other policies have.
    saved = night_run(data_dir, resolved.name)
    if saved is None or (saved.get("policy") or default) != policy:
        raise _refused(path, policy, "no run of this data directory trained it for this policy")
    return str(resolved)


def _refused(path: str, policy: str, why: str) -> NotOwnAdapter:
    return NotOwnAdapter(
        f"an admin token of policy {policy!r} promotes that policy's own adapters only "
        f"(its nights', or one its state names); not {path!r:.300}: {why}"
    )
