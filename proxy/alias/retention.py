"""Which adapters stay on disk, and deleting the rest: every night writes one.

On a 7B model a rank-16 adapter on every linear layer is about 80 MB (docs/operations.md),
written each night whether promoted or refused, into DATA/adapters/<run>/, with a
bucket also uploaded (`adapters/<key>`) and copied into adapter-cache/. Kept:

  the adapter the alias serves and the canary;
  the previous `keep` of the promotion stack: what a rollback serves again;
  each policy's best adapter so far, as the gate's records place it (what a not-worse
  gate holds each candidate to: storage/read/best_adapter.py), however old;
  every adapter a replica has loaded, or that serves requests still in flight;
  each policy's newest night's adapter directory (a refused candidate, to look at; a
  night's policy is its run's, DATA/runs/<run>/run.json, none named: the default
  policy's), and those of runs not finished (a resumed run trains on).

Everything else under DATA/adapters/, in adapter-cache/ and among the bucket's uploads
is deleted; nothing outside those places (an adapter promoted from the operator's own
directory stays where it is). The registry runs this under its promotion lock and the
shared state's, so no promotion can pick an adapter while it goes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from overnight.storage.bucket import adapter_sync
from overnight.storage.location import SegmentStore, segment_store
from overnight.storage.read.best_adapter import kept_best

log = logging.getLogger("overnight.proxy")

ADAPTERS_DIR = "adapters"  # DATA/adapters/<run>: what the nights write
RUNS_DIR = "runs"


@dataclass
class Pruned:
    keep: int
    kept: list[str] = field(default_factory=list)  # paths and URLs, with the reason
    deleted: list[str] = field(default_factory=list)
    bytes: int = 0  # local bytes the deleted take (the bucket's are not listed)
    done: bool = False  # deleted, or only planned

    def lines(self) -> list[str]:
        verb = "deleted" if self.done else "would delete"
        out = [f"adapters: keeping {len(self.kept)}, {verb} {len(self.deleted)} "
               f"({self.bytes / 1e6:.1f} MB on local disk)"]  # fmt: skip
        out += [f"  keep {k}" for k in self.kept]
        out += [f"  {verb} {d}" for d in self.deleted]
        return out

    def as_dict(self) -> dict:
        return {"keep": self.keep, "kept": self.kept, "deleted": self.deleted,
                "bytes": self.bytes, "done": self.done}  # fmt: skip


def kept_adapters(state: dict, keep: int, loaded: set[str]) -> dict[str, str]:
    """path or upload -> why it stays, from the promotion state (adapters.json's shape)."""
    by_name = {a["name"]: a for a in state.get("adapters") or []}
    stack = [by_name[n] for n in state.get("stack") or [] if n in by_name]
    why: dict[str, str] = {}

    def hold(adapter: dict | None, reason: str) -> None:
        if adapter is None:
            return
        for where in (adapter.get("path"), adapter.get("source")):
            if where:
                why.setdefault(str(where), f"{reason} ({adapter['name']})")

    if stack:
        hold(stack[-1], "served")
    hold(by_name.get((state.get("canary") or {}).get("name", "")), "canary")
    for adapter in reversed(stack[-1 - keep : -1] if keep else []):
        hold(adapter, "rollback target")
    for name in sorted(loaded):
        hold(by_name.get(name), "loaded on a replica")
    return why


def plan(
    data_dir: Path,
    store: SegmentStore,
    states: list[dict],
    keep: int,
    loaded: set[str],
    default: str | None = None,
) -> Pruned:
    """What `delete` would delete (nothing is touched). `states`: every policy's promotion
    state, the default policy's first (adapters are the data directory's: one policy's
    prune keeps the others'); `default`: its name (None: as its state names it)."""
    default = default or (states[0] if states else {}).get("alias")
    why: dict[str, str] = {}
    for state in states:
        why = {**kept_adapters(state, keep, loaded), **why}
        best = _best_so_far(data_dir, state, default)
        if best is not None:
            why.setdefault(best, f"the gate's best so far of policy {state.get('alias')}")
    out = Pruned(keep)
    nights = sorted((data_dir / ADAPTERS_DIR).glob("*"), key=lambda p: p.name)
    nights = [p for p in nights if p.is_dir() and not p.name.startswith(".")]
    unfinished = {
        p.name
        for p in (data_dir / RUNS_DIR).glob("*")
        if p.is_dir() and not (p / "finished").exists()
    }
    newest = _newest_by_policy(data_dir, nights, default)
    for night in nights:
        reason = why.get(str(night.resolve())) or why.get(str(night))
        if reason is None and night in newest:
            reason = newest[night]
        if reason is None and night.name in unfinished:
            reason = "its run is not finished"
        _sort(out, str(night), reason, night)
    cache = adapter_sync.cache_dir(store)
    for copy in sorted(cache.glob("*")) if cache.is_dir() else []:
        if copy.name.startswith("."):
            continue
        source = f"{store.url}/{adapter_sync.FOLDER}/{copy.name}" if store.url else None
        reason = why.get(str(copy)) or (why.get(source) if source else None)
        _sort(out, str(copy), reason, copy)
    if store.url is not None:
        for source in _uploads(store):
            _sort(out, source, why.get(source), None)
    return out


def night_run(data_dir: Path, run: str) -> dict | None:
    """What the night `run` saved before it trained (DATA/runs/<run>/run.json: its groups,
    start adapter, policy), or None where there is none to read."""
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads((Path(data_dir) / RUNS_DIR / run / "run.json").read_text())
        return saved if isinstance(saved, dict) else None
    return None


def _best_so_far(data_dir: Path, state: dict, default: str | None) -> str | None:
    """The policy's best adapter so far (storage/read/best_adapter.py): a not-worse gate
    holds each candidate to it, so it stays however many promotions came after it. Records
    that cannot be read keep nothing more (logged)."""
    try:
        return kept_best(data_dir, state, default)
    except (duckdb.Error, OSError, ValueError, TypeError, KeyError) as e:
        log.warning("retention: the gate's best adapter so far not found (%s)", e)
        return None


def _newest_by_policy(data_dir: Path, nights: list[Path], default: str | None) -> dict:
    """Each policy's newest night (its run's policy; none, or no run: the default's) ->
    why it stays. Nights sort by run id, which starts with its time."""
    newest: dict[str | None, Path] = {}
    for night in nights:
        newest[(night_run(data_dir, night.name) or {}).get("policy") or default] = night
    several = len(newest) > 1
    return {
        night: "the newest night's" + (f" of policy {policy}" if several and policy else "")
        for policy, night in newest.items()
    }


def delete(data_dir: Path, store: SegmentStore, pruned: Pruned) -> Pruned:
    """Delete what `pruned` lists: uploads manifest first (an upload without its
    manifest is never fetched), then their files; local directories whole."""
    for where in pruned.deleted:
        if where.startswith(f"{store.url}/") if store.url else False:
            key = where.rsplit("/", 1)[1]
            root = store.key(adapter_sync.FOLDER)
            store.fs.rm(f"{root}/{key}.json")
            store.fs.rm(f"{root}/{key}", recursive=True)
        else:
            shutil.rmtree(where, ignore_errors=True)
        log.info("deleted the adapter %s", where)
    pruned.done = True
    return pruned


def _sort(out: Pruned, where: str, reason: str | None, local: Path | None) -> None:
    if reason is not None:
        out.kept.append(f"{where}: {reason}")
        return
    out.deleted.append(where)
    if local is not None:
        out.bytes += sum(f.stat().st_size for f in local.rglob("*") if f.is_file())


def _uploads(store: SegmentStore) -> list[str]:
    """The bucket's finished adapter uploads (those with a manifest)."""
    root = store.key(adapter_sync.FOLDER)
    try:
        names = store.fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    keys = sorted(n.rsplit("/", 1)[1][: -len(".json")] for n in names if n.endswith(".json"))
    return [f"{store.url}/{adapter_sync.FOLDER}/{k}" for k in keys]


def prune_offline(data_dir: Path, keep: int, dry_run: bool) -> Pruned:
    """`overnight prune --adapters` with no proxy serving the data directory: under the
    state file's lock, nothing loaded anywhere (the proxy, and the vLLM it launched, are
    down). With a bucket another machine's proxy may be promoting: refused."""
    from overnight.errors import OvernightError

    from .promotions import open_state, policy_state_paths

    store = segment_store(data_dir)
    if store.url is not None:
        raise OvernightError(
            "with a bucket, prune adapters through a running proxy (--proxy URL): another "
            "machine's proxy may be loading one",
            status=409,
        )
    files = [open_state(path, data_dir) for path in policy_state_paths(data_dir)]
    with contextlib.ExitStack() as locks:
        for state_file in files:
            locks.enter_context(state_file.locked_blocking())
        states = [state_file.read() for state_file in files]
        pruned = plan(data_dir, store, states, keep, set())
        return pruned if dry_run else delete(data_dir, store, pruned)
