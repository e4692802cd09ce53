"""What the promotion state holds (adapters, routes, the canary's share) and the
offline rollback, for the registry (registry.py) and for the CLI when no proxy runs."""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from overnight.proxy.replicas.lora_client import AdapterError
from overnight.storage.location import segment_store

from .bucket_state import BucketState
from .state_file import StateFile

EVENTS_KEPT = 200  # promotions, rollbacks and canary decisions kept in adapters.json
STATE_FILE = "adapters.json"
POLICIES_DIR = "policies"  # DATA/policies/NAME/adapters.json: a policy but the default's
# A versioned adapter's name: its policy, its version, six hex digits (registry.py).
ADAPTER_NAME = re.compile(r"(.+)-v\d+-[0-9a-f]{6}")


def state_path(data_dir: Path, policy: str, default: str) -> Path:
    """Where `policy`'s promotion state lives: the default policy's is DATA/adapters.json
    (so a data directory of one alias reads as it, unchanged), any other's its own file."""
    if policy == default:
        return Path(data_dir) / STATE_FILE
    return Path(data_dir) / POLICIES_DIR / policy / STATE_FILE


def offline_state_path(data_dir: Path, policy: str | None) -> Path:
    """The state file of `policy` when no proxy runs to say which policy is the default:
    the one whose state names it as its alias (None: DATA/adapters.json, as before)."""
    if policy is None:
        return Path(data_dir) / STATE_FILE
    for path in policy_state_paths(data_dir):
        with contextlib.suppress(OSError, ValueError):
            if json.loads(path.read_text()).get("alias") == policy:
                return path
    raise AdapterError(
        f"no promotion state of a policy {policy!r} in {data_dir}: nothing was ever "
        "promoted to it here (the policies with one: "
        f"{', '.join(_aliases(data_dir)) or 'none'})",
        status=404,
    )


def _aliases(data_dir: Path) -> list[str]:
    out = []
    for path in policy_state_paths(data_dir):
        with contextlib.suppress(OSError, ValueError):
            out.append(str(json.loads(path.read_text()).get("alias")))
    return out


def policy_state_paths(data_dir: Path) -> list[Path]:
    """Every promotion state on disk in `data_dir` (the default policy's first), whichever
    policies a proxy serves now: what an offline prune must keep the adapters of."""
    data_dir = Path(data_dir)
    others = sorted((data_dir / POLICIES_DIR).glob(f"*/{STATE_FILE}"))
    return [data_dir / STATE_FILE, *others]


def open_state(path: Path, data_dir: Path | None = None) -> StateFile | BucketState:
    """The promotion state at `path` (DATA/adapters.json, or a policy's
    DATA/policies/NAME/adapters.json: then `data_dir` says where DATA is): that file, or,
    when the data directory's segments are in a bucket, the same name in the bucket."""
    path = Path(path)
    data_dir = path.parent if data_dir is None else Path(data_dir)
    store = segment_store(data_dir)
    if not store.remote:
        return StateFile(path)
    return BucketState(store, path, path.relative_to(data_dir).as_posix())


@dataclass(frozen=True)
class Adapter:
    name: str  # the name vLLM serves it under
    version: int
    path: str
    promoted_at: str
    reason: str = "promote"  # promote | rollback | restore | canary
    # With a bucket: its upload (storage/bucket/adapter_sync.py), which every proxy loads a
    # local copy of; None with a local data directory, where `path` is loaded.
    source: str | None = None


def stored(adapter: Adapter) -> dict:
    """`adapter` as the state keeps it (no `source` key without a bucket, as before)."""
    out = asdict(adapter)
    if out["source"] is None:
        del out["source"]
    return out


def serving(state: dict) -> tuple[Adapter | None, Adapter | None]:
    """What `state` serves: the alias's adapter and the canary."""
    by_name = {a["name"]: a for a in state.get("adapters", [])}
    top = by_name.get(state["stack"][-1]) if state.get("stack") else None
    canary = by_name.get((state.get("canary") or {}).get("name", ""))
    return (Adapter(**top) if top else None, Adapter(**canary) if canary else None)


def canary_state(canary: Adapter | None, fraction: float) -> dict | None:
    return {"name": canary.name, "fraction": fraction} if canary else None


def history_event(action: str, adapter: Adapter, why: str, serves: Adapter | None) -> dict:
    """One line of the history of what the alias served (`serves`: after it), and why."""
    return {
        "at": dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds"),
        "action": action,
        "adapter": adapter.name,
        "path": adapter.path,
        "serves": serves.name if serves else None,
        "reason": why,
    }


def in_canary(key: str, fraction: float) -> bool:
    """Whether the rollout `key` is in the canary's share: a hash, the same in every process."""
    return _hashed(b"canary\0", key) < fraction * 2**64


def served_locally(key: str | None, share: float) -> bool:
    """Whether the rollout `key` is in a handover's local share (proxy/routes/handover.py):
    the canary's hash under a salt of its own, so that a canary's rollouts and the local
    ones are drawn independently. No key: the hosted model (until the share is whole)."""
    return share >= 1.0 or (key is not None and _hashed(b"handover\0", key) < share * 2**64)


def _hashed(salt: bytes, key: str) -> int:
    return int.from_bytes(hashlib.blake2b(salt + key.encode(), digest_size=8).digest())


@dataclass(frozen=True)
class Route:
    served: str  # model name sent upstream
    version: int | None  # adapter version, None for the base model or a pass-through
    policy: str | None = None  # the alias asked for; None: a pass-through
    hosted: bool = False  # sent to the hosted model beside vLLM (a handover's other side)


def rollback_on_disk(
    state_path: Path, why: str = "", data_dir: Path | None = None
) -> Adapter | None:
    """The rollback for when no proxy runs on this data directory: drop the newest
    promotion from `adapters.json` (in the bucket, with `--data s3://...`), so the next
    `overnight serve` restores the one before it (or serves the base model). Returns
    what will serve. (A proxy that does run follows the change too, loading that adapter
    again.) `data_dir`: DATA, for a policy's state below it (DATA/policies/NAME)."""
    shared = open_state(state_path, data_dir)
    with shared.locked_blocking():
        state = shared.read()
        if not state:
            raise AdapterError("nothing to roll back: no adapter was ever promoted here")
        if not state.get("stack"):
            raise AdapterError("nothing to roll back: the alias already serves the base model")
        gone = state["stack"].pop()
        now = dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
        event = {"at": now, "action": "rollback", "adapter": gone, "reason": why}
        event["serves"] = state["stack"][-1] if state["stack"] else None
        state["events"] = [*state.get("events", []), event][-EVENTS_KEPT:]
        shared.write(state)
    return serving(state)[0]
