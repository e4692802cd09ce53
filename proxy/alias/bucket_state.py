"""The promotion state in a bucket, for proxies on machines that share no disk.

With `--data s3://bucket/prefix` every proxy follows `s3://bucket/prefix/adapters.json`,
the bucket variant of DATA/adapters.json (state_file.StateFile), with the same
interface: `stamp()`, `read()`, `write()` as the next version, `locked()`.

- **Change detection**: `stamp()` is the object's ETag (one HEAD request): a follower
  polling every second makes 86,400 requests a day, about $0.035 a day on S3 at
  $0.0004 per 1,000 (`--state-poll-interval` to poll less often).
- **No two writers take one version**: `write()` is a PUT with `If-Match` on the ETag
  of the `read()` it follows (`If-None-Match: *` for the first state), so a write based
  on a state that changed meanwhile is refused (409) instead of overwriting it.
- **Taking turns**: `locked()` is a lease, `adapters.json.lock`, created with
  `If-None-Match: *` and deleted after; one left by a dead proxy is taken over once it
  expires (`LEASE_SECONDS`), with `If-Match` so that only one waiter takes it. The
  lease spares a loser its adapter loads; the conditional write alone keeps the state
  right, even when a lease expired under a slow promotion.
- **A copy on local disk**: each state read or written is mirrored to the local data
  directory's adapters.json, which `/ui` and `overnight runs` read, and from which a
  proxy starts when the bucket cannot be reached (it follows the bucket once it can).
- The draining marks (`adapters.json.draining/`) stay in the local data directory: they
  matter to proxies that share vLLM replicas, and with a bucket those are the proxies
  of one machine (vLLM loads an adapter from the machine's local copy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from overnight.proxy.replicas.lora_client import AdapterError
from overnight.storage.bucket import adapter_sync
from overnight.storage.bucket.conditional import ABSENT, delete, etag, get, put_if
from overnight.storage.location import SegmentStore, data_url

from .state_file import parse_state, write_state

log = logging.getLogger("overnight.proxy")
# A lease outlives the loads of one promotion on every replica; a dead proxy's lease
# holds promotions back this long at most.
LEASE_SECONDS = 60.0
_LEASE_POLL = 0.2


class StateUnreachable(AdapterError):
    status = 503
    code = "state_unreachable"


class BucketState:
    remote = True

    def __init__(self, store: SegmentStore, mirror: Path, name: str | None = None):
        self.store = store
        self.url = store.url or ""
        self.path = Path(mirror)  # the local copy; what log lines name
        # Its name under the prefix: adapters.json, or a policy's policies/NAME/adapters.json.
        self.name = name or self.path.name
        self.key = store.key(self.name)
        self.lock_key = f"{self.key}.lock"
        self._seen: str | None = ABSENT  # the ETag the last read saw, for write's If-Match
        self._seen_version = 0

    def stamp(self) -> str | None:
        """The ETag (one HEAD); None while nothing was ever promoted here."""
        return etag(self.store.fs, self.url, self.key)

    def initial(self) -> tuple[str | None, dict]:
        """What a starting proxy serves: the bucket's state, or the local copy (with a
        stamp no bucket answer equals, so the first poll that reaches it reads it)."""
        try:
            return self.stamp(), self.read()
        except OSError as e:
            log.warning(
                "%s: cannot read the promotion state (%s); serving the local copy", self.url, e
            )
            try:
                state = json.loads(self.path.read_text())
            except (OSError, ValueError):
                state = {}
            state.setdefault("version", 0)
            return "unreachable", state

    def read(self) -> dict:
        """The state ({} when nothing was ever promoted here); remembers its ETag."""
        data, tag = get(self.store.fs, self.url, self.key)
        if data is None:
            self._seen, self._seen_version = ABSENT, 0
            return {}
        state = parse_state(data, f"{self.url}/{self.name}")
        self._seen, self._seen_version = tag, state["version"]
        self._mirror(state)
        return state

    def write(self, state: dict) -> dict:
        """Write `state` as the version after the last `read` (call under `locked`);
        refused (409) when the bucket's state changed since that read."""
        state = dict(state, version=self._seen_version + 1)
        body = json.dumps(state, indent=2).encode()
        tag = put_if(self.store.fs, self.url, self.key, body, self._seen)
        if tag is None:
            raise AdapterError(
                f"another proxy changed the promotion state in {self.url} meanwhile; "
                "nothing was changed: try again",
                status=409,
                code="state_conflict",
            )
        self._seen, self._seen_version = tag, state["version"]
        self._mirror(state)
        return state

    @contextlib.asynccontextmanager
    async def locked(self) -> AsyncIterator[None]:
        # The wait runs in a thread: it holds one only while another promotion runs.
        lease = await asyncio.to_thread(self._lease)
        try:
            yield
        finally:
            await asyncio.to_thread(lease.give_back)

    @contextlib.contextmanager
    def locked_blocking(self) -> Iterator[None]:
        lease = self._lease()
        try:
            yield
        finally:
            lease.give_back()

    def _lease(self) -> _Lease:
        """The lease, once taken (polling while another holder has it, up to twice its
        length: an expired one is taken over)."""
        lease = _Lease(self)
        deadline = time.monotonic() + 2 * LEASE_SECONDS
        while not lease.take():
            if time.monotonic() > deadline:
                raise StateUnreachable(f"{self.lock_key}: {lease.holder} keeps the lease")
            time.sleep(_LEASE_POLL)
        return lease

    def _mirror(self, state: dict) -> None:
        """Keep the local copy at the newest version seen (workers race harmlessly)."""
        try:
            known = json.loads(self.path.read_text()).get("version", -1)
        except (OSError, ValueError):
            known = -1
        if known == state["version"]:
            return
        try:
            write_state(self.path, state)
        except OSError as e:
            log.warning("could not keep a local copy of the promotion state: %s", e)


class _Lease:
    """One attempt at a time to hold `adapters.json.lock` (see the module's docstring)."""

    def __init__(self, state: BucketState):
        self.state = state
        self.token = secrets.token_hex(8)
        self.holder = "nobody"

    def take(self) -> bool:
        fs, url, key = self.state.store.fs, self.state.url, self.state.lock_key
        mine = {"owner": self.token, "host": socket.gethostname(), "pid": os.getpid()}
        body = json.dumps({**mine, "until": time.time() + LEASE_SECONDS}).encode()
        try:
            if put_if(fs, url, key, body, ABSENT) is not None:
                return True
            data, tag = get(fs, url, key)
            if data is None:
                return False  # given back meanwhile: try again
            if not self._expired(data):
                return False
            log.warning("taking over the promotion lease of %s: it expired", self.holder)
            return put_if(fs, url, key, body, tag) is not None
        except OSError as e:
            raise StateUnreachable(f"the promotion state in {url} cannot be reached: {e}") from e

    def _expired(self, data: bytes) -> bool:
        try:
            held = json.loads(data)
            self.holder = f"{held.get('host')} (pid {held.get('pid')})"
            return float(held.get("until", 0)) <= time.time()
        except (ValueError, TypeError, AttributeError):
            return True  # a damaged lease: replace it

    def give_back(self) -> None:
        fs, url, key = self.state.store.fs, self.state.url, self.state.lock_key
        try:
            data, _ = get(fs, url, key)
            if data is not None and json.loads(data).get("owner") == self.token:
                delete(fs, url, key)
        except (OSError, ValueError) as e:  # it expires by itself
            log.warning("could not give the promotion lease back (%s); it expires", e)


class AdapterFiles:
    """Where the replicas load an adapter from. With a local data directory: its path,
    as promoted. With a bucket: the local copy of its upload (adapter_sync.py), uploaded
    by the promoting proxy and fetched, whole and checked, by every other proxy before it
    follows the promotion."""

    def __init__(self, store: SegmentStore | None):
        self.store = store

    @classmethod
    def of(cls, state: object) -> AdapterFiles:
        return cls(state.store if isinstance(state, BucketState) else None)

    async def prepare(self, path: str, policy: str | None = None) -> tuple[str, str | None]:
        """What a promotion of `path` records: the adapter's path and, with a bucket, its
        upload (made now, for the proxies of other machines, naming `policy`). `path` may
        be an upload already (`s3://.../adapters/<key>`, made with adapter_sync.publish
        where the adapter was trained): it is fetched and checked here first."""
        if data_url(path) is not None and self.store is not None:
            local = Path(await self.local(path, path))
        else:
            path = str(Path(path).expanduser().resolve())
            local = Path(path)
        if not (local / "adapter_config.json").is_file():
            raise AdapterError(f"{path} is not a peft adapter directory (no adapter_config.json)")
        if self.store is None:
            return path, None
        if data_url(path) is not None:
            return path, path  # uploaded where it was trained
        return path, await self._publish(path, policy)

    async def _publish(self, path: str, policy: str | None) -> str | None:
        """Upload `path` for the other proxies; its URL in the bucket."""
        assert self.store is not None
        try:
            source, _ = await asyncio.to_thread(
                adapter_sync.publish, self.store, Path(path), policy
            )
        except OSError as e:
            raise StateUnreachable(f"could not upload {path} to {self.store.url}: {e}") from e
        return source

    async def local(self, path: str, source: str | None) -> str:
        """The path a replica loads: `path`, or the local copy of `source`."""
        if source is None or self.store is None:
            return path
        try:
            return str(await asyncio.to_thread(adapter_sync.fetch, self.store, source))
        except OSError as e:
            raise StateUnreachable(f"could not fetch {source}: {e}") from e

    async def ready(self, state: dict) -> bool:
        """Whether what `state` serves (the alias's adapter, the canary) is here, fetched
        now if need be; False (and why, logged) when it cannot be: keep the old state."""
        if self.store is None:
            return True
        by_name = {a["name"]: a for a in state.get("adapters", [])}
        wanted = [*state.get("stack", [])[-1:], (state.get("canary") or {}).get("name")]
        for adapter in (by_name.get(n) for n in wanted if n):
            if adapter and adapter.get("source"):
                try:
                    await self.local(adapter["path"], adapter["source"])
                except AdapterError as e:
                    log.error("not following version %s yet: %s", state.get("version"), e)
                    return False
        return True
