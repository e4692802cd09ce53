"""Trained adapters through a bucket, for proxies on machines that share no disk.

vLLM loads a LoRA adapter from a path on its own machine, so with `--data s3://...`
the proxy that promotes an adapter uploads its directory to the bucket and every proxy
that follows the promotion downloads it into its local data directory first.

In the bucket an adapter is `adapters/<key>/<its files>` plus `adapters/<key>.json`,
its manifest (every file's name, size and sha256; the policy it was trained for),
written last: an adapter without a manifest is an upload that has not finished (or
died) and is never fetched. `<key>` is a hash of the manifest's files and policy, so
the same weights are uploaded once per policy, and a manifest that does not hash to its
key is refused. A download goes to a temporary directory, each
file is checked against the manifest, and only then is the directory renamed into
`adapter-cache/<key>` in the local data directory: a proxy loads only whole, checked
copies. The promoting proxy puts its own copy there too, so that every proxy, on every
machine, loads an adapter from the same kind of place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
from pathlib import Path, PurePosixPath

from overnight.storage.location import SegmentStore

from .conditional import etag, get, on_bucket, put

FOLDER = "adapters"  # in the bucket, beside the tables
CACHE = "adapter-cache"  # in the local data directory
_CHUNK = 1 << 20


class AdapterSyncError(OSError):
    """An adapter in the bucket is missing, unfinished or does not match its manifest."""


def manifest_of(path: Path) -> dict:
    """Every file under `path` (relative POSIX names, sorted) with its size and sha256."""
    files = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        files.append(
            {
                "name": file.relative_to(path).as_posix(),
                "size": file.stat().st_size,
                "sha256": _sha256(file),
            }
        )
    if not files:
        raise AdapterSyncError(f"{path}: no files to upload")
    return {"files": files}


def key_of(manifest: dict) -> str:
    # The policy it names is hashed with the files: an upload is one policy's (the same
    # weights published for two policies are two uploads, not the first one's), and a
    # manifest whose "policy" was edited no longer hashes to its key. Without a policy
    # (uploads from before policies), the files alone, as then.
    named = manifest.get("policy")
    hashed = manifest["files"] if named is None else {"files": manifest["files"], "policy": named}
    canonical = json.dumps(hashed, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:24]


def publish(store: SegmentStore, path: Path, policy: str | None = None) -> tuple[str, Path]:
    """Upload the adapter at `path` (unless the bucket has it whole already) and keep a
    copy in the local cache. Returns its URL in the bucket and the local copy. `policy`:
    the one it was trained for, named in its manifest (and hashed into its key): what a
    per-policy admin token may promote (proxy/alias/ownership.py)."""
    assert store.url is not None, "a local data directory shares adapters by path"
    manifest = manifest_of(path)
    if policy is not None:
        manifest["policy"] = policy
    key = key_of(manifest)
    root = store.key(FOLDER)
    if etag(store.fs, store.url, f"{root}/{key}.json") is None:
        with on_bucket(store.url, f"uploading the adapter {path}"):
            for f in manifest["files"]:
                store.fs.put_file(str(path / f["name"]), f"{root}/{key}/{f['name']}")
        put(store.fs, store.url, f"{root}/{key}.json", json.dumps(manifest).encode())
    local = cache_dir(store) / key
    if not local.is_dir():
        tmp = _scratch(local)
        shutil.copytree(path, tmp)
        _check(tmp, manifest, f"the copy of {path}")
        _settle(tmp, local)
    return f"{store.url}/{FOLDER}/{key}", local


def fetch(store: SegmentStore, source: str) -> Path:
    """The local copy of the adapter at `source` (a URL `publish` returned), downloaded
    and checked first if this machine does not have it yet."""
    key = _upload_key(store, source)
    local = cache_dir(store) / key
    if local.is_dir():
        return local
    remote = f"{store.key(FOLDER)}/{key}"
    manifest, names = _manifest(store, source, key)
    tmp = _scratch(local)
    try:
        with on_bucket(store.url, f"downloading the adapter {source}"):
            for name in names:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                store.fs.get_file(f"{remote}/{name}", str(tmp / name))
        _check(tmp, manifest, source)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _settle(tmp, local)
    return local


def upload_policy(store: SegmentStore, source: str) -> str | None:
    """The policy the upload at `source` was trained for, as its manifest names it (None:
    it names none, as uploads from before policies)."""
    manifest, _ = _manifest(store, source, _upload_key(store, source))
    policy = manifest.get("policy")
    return policy if isinstance(policy, str) else None


def _upload_key(store: SegmentStore, source: str) -> str:
    """The key of `source`, which must be an upload of this store: a URL given to the
    admin API must not make a proxy read whatever else its credentials reach."""
    assert store.url is not None
    folder = f"{store.url}/{FOLDER}/"
    key = source.rstrip("/").removeprefix(folder)
    if not source.startswith(folder) or not re.fullmatch(r"[0-9a-f]{24}", key):
        raise AdapterSyncError(f"{source}: not an adapter uploaded to {folder}")
    return key


def _manifest(store: SegmentStore, source: str, key: str) -> tuple[dict, list[str]]:
    """The finished upload's manifest, checked against its key, and its files' names."""
    data, _ = get(store.fs, store.url, f"{store.key(FOLDER)}/{key}.json")
    if data is None:
        raise AdapterSyncError(f"{source}: no manifest: its upload has not finished")
    try:
        manifest = json.loads(data)
        names = [_safe_name(f["name"]) for f in manifest["files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise AdapterSyncError(f"{source}: its manifest is damaged: {e}") from e
    if key_of(manifest) != key:
        raise AdapterSyncError(f"{source}: its manifest does not hash to its name")
    return manifest, names


def cache_dir(store: SegmentStore) -> Path:
    return store.data_dir / CACHE


def _check(directory: Path, manifest: dict, what: str) -> None:
    """Every file of the manifest is there with its size and hash; nothing else is."""
    want = {f["name"]: f for f in manifest["files"]}
    found = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    if found != set(want):
        raise AdapterSyncError(
            f"{what}: files {sorted(found ^ set(want))} differ from its manifest"
        )
    for name, f in want.items():
        file = directory / name
        if file.stat().st_size != f["size"] or _sha256(file) != f["sha256"]:
            raise AdapterSyncError(f"{what}: {name} does not match its manifest")


def _scratch(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(3)}.tmp")


def _settle(tmp: Path, final: Path) -> None:
    """Rename the checked copy into place; another process that got there first wins."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _safe_name(name: str) -> str:
    """A manifest names files inside the adapter only (no `..`, no absolute path)."""
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or ".." in parts:
        raise AdapterSyncError(f"a manifest names {name!r}, outside the adapter")
    return name


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
