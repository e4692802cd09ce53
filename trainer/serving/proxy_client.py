"""The trainer's side of the proxy's admin API: what is served, and promoting a new adapter.

Plain urllib: a nightly job makes two or three calls, and the CLI's `rollback` uses
the same client without importing torch. A call about one policy (proxy/alias/
policies.py) says it in the query, `?policy=NAME`; without it the proxy answers for its
default policy, as before there were policies.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from overnight.errors import OvernightError
from overnight.storage import data_url, segment_store
from overnight.storage.bucket import adapter_sync


class ProxyError(OvernightError):
    """The proxy could not be reached, or refused an admin call."""

    code = "proxy_error"


def admin_call(
    proxy_url: str,
    path: str,
    token: str | None,
    payload: dict | None = None,
    policy: str | None = None,
) -> dict:
    """GET `path` (POST `payload` as JSON when given) under the proxy's admin token, about
    `policy` (None: the proxy's default policy)."""
    query = f"?{urllib.parse.urlencode({'policy': policy})}" if policy is not None else ""
    request = urllib.request.Request(
        proxy_url.rstrip("/") + path + query,
        method="POST" if payload is not None else "GET",
        data=json.dumps(payload).encode() if payload is not None else None,
        headers={
            "Content-Type": "application/json",
            **({"Authorization": f"Bearer {token}"} if token else {}),
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise ProxyError(
            f"the proxy answered {e.code} to {path}: {e.read().decode(errors='replace')[:500]}"
        ) from e
    except OSError as e:
        raise ProxyError(f"cannot reach the proxy at {proxy_url}: {e}") from e


def serving_state(proxy_url: str | None, token: str | None, policy: str | None = None) -> dict:
    """The proxy's adapters of `policy` and its base model ({} without a proxy); the
    names of all its policies under `policies`, the default one under `default`."""
    return admin_call(proxy_url, "/admin/adapters", token, policy=policy) if proxy_url else {}


def proxy_policies(proxy_url: str | None, token: str | None) -> list[str]:
    """The policies the proxy serves, its default first (a proxy from before policies:
    its one alias); [] without a proxy, or when it cannot be asked (the night then
    fails, or runs without one, as it did before policies)."""
    try:
        state = serving_state(proxy_url, token)
    except ProxyError:
        return []
    return list(state.get("policies") or [state["alias"]]) if state else []


def served_adapter(state: dict) -> str | None:
    """The path of the adapter the proxy serves now (None: the base model)."""
    return (state.get("current") or {}).get("path")


def base_model_of(state: dict) -> str | None:
    """The base model the proxy's vLLM serves, as a path where it knows one."""
    return state.get("base_model_path") or state.get("base_model") or None


def promote_adapter(
    proxy_url: str, token: str | None, adapter_dir, policy: str | None = None
) -> str:
    """Have the proxy load `adapter_dir` and serve it under `policy`'s alias; the new name."""
    payload = {"path": str(adapter_dir)}
    return admin_call(proxy_url, "/admin/adapters/promote", token, payload, policy)["promoted"]


def shared_adapter(data_dir: Path, adapter_dir: Path, policy: str | None = None) -> str:
    """How the proxies are told of an adapter trained here, and how their state names it:
    its path with a local data directory; with a bucket, its upload (published now,
    naming `policy`, which a per-policy admin token's promotion is checked against), so
    a trainer on a GPU node that shares no disk with the proxies can promote it."""
    store = segment_store(data_dir)
    if store.url is None:
        return str(Path(adapter_dir).resolve())
    url, _ = adapter_sync.publish(store, Path(adapter_dir), policy)
    return url


def local_adapter(data_dir: Path, adapter: str | None) -> str | None:
    """A path this machine loads `adapter` (as the proxies' state names it) from: an
    upload in the bucket is downloaded and checked first (storage/bucket/adapter_sync.py)."""
    if adapter is None or data_url(adapter) is None:
        return adapter
    return str(adapter_sync.fetch(segment_store(data_dir), adapter))


def prune_adapters(
    proxy_url: str, token: str | None, keep: int, say=print, policy: str | None = None
) -> dict | None:
    """After a night: the proxy deletes adapters beyond the served one, a canary and the
    previous `keep` of every policy (proxy/alias/retention.py). A failure is said,
    never fatal."""
    try:
        pruned = admin_call(proxy_url, "/admin/adapters/prune", token,
                            {"keep": keep, "dry_run": False}, policy)  # fmt: skip
    except ProxyError as e:
        say(f"warning: adapters not pruned: {e}")
        return None
    if pruned["deleted"]:
        say(f"adapters: deleted {len(pruned['deleted'])} ({pruned['bytes'] / 1e6:.1f} MB), "
            f"kept {len(pruned['kept'])} (--keep-adapters {keep})")  # fmt: skip
    return pruned
