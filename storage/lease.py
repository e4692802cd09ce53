"""A lease on a name: one holder at a time, across the processes of one data directory and
across the machines that share its bucket. The holder renews it; one that stopped renewing
(killed, hung, its machine gone) is taken over once its lease has run out.

Where it lives: `DATA/locks/NAME.json` on a local data directory; with `--data
s3://bucket/prefix`, the object `locks/NAME.json` under the prefix, written with the
conditional PUTs the merge manifests and the promotion state use (bucket/conditional.py),
so machines that share the bucket take turns. Other filesystems (gs://, az://) have no
conditional write: there the lease is only as safe as one writer at a time, as the
promotion state is (docs/deployment.md).

One small JSON object: {"holder": {...} or null, "notes": {...}}. `notes` is what holders
leave for the next one (overnight/night/ keeps a policy's last cycle there), so every
machine reads one history. Every change is a compare-and-swap on what was read: a PUT with
If-None-Match (absent) or If-Match (its ETag) in a bucket; locally, the file read again
and compared under an flock of its own, then replaced whole. So of two takers exactly one
wins, and a renewal after a take-over fails instead of stealing the lease back.

A lease is free when it has no holder, when its `until` has passed (wall-clock time:
machines sharing a bucket need clocks within a small part of the lease, as NTP keeps
them), or when its holder ran on this machine and its process no longer exists (a night
killed with SIGKILL frees it at once for the next one on its own machine).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from overnight.errors import OvernightError

from .files import create_private, private_dir, replace_durably
from .location import segment_store

LOCKS = "locks"
# Long enough that a renewal (every third of it) survives a slow bucket or a busy machine
# twice over; short enough that a holder whose machine vanished blocks others a minute.
LEASE_SECONDS = 60.0
_NAME = re.compile(r"[A-Za-z0-9._-]{1,100}")


@dataclass(frozen=True)
class Holder:
    """Who holds a lease, and until when (Unix seconds)."""

    owner: str  # a random token: the one process (and lease object) that took it
    what: str  # what holds it, in words (`overnight learn`, `overnight train`)
    host: str
    pid: int
    since: float
    until: float

    def describe(self) -> str:
        return (
            f"{self.what} (pid {self.pid} on {self.host}, since {_clock(self.since)}, "
            f"its lease renewed until {_clock(self.until)})"
        )

    def gone(self, now: float) -> bool:
        """Free to take: its lease ran out, or its process on this machine is gone."""
        return self.until <= now or (self.host == socket.gethostname() and not _alive(self.pid))


class LeaseHeld(OvernightError):
    """Another holder has the lease now; the message names it."""

    status = 409
    code = "lease_held"

    def __init__(self, name: str, holder: Holder):
        super().__init__(f"{name} is held by {holder.describe()}")
        self.holder = holder


class LeaseLost(OvernightError):
    """The lease ran out and someone else took it before this holder renewed it."""

    status = 409
    code = "lease_lost"


class Lease:
    """The lease on `name` in `data_dir` (see the module's docstring), for `what` (words
    naming the holder in a refusal). `clock`: wall-clock seconds, for the tests."""

    def __init__(
        self,
        data_dir: str | os.PathLike,
        name: str,
        what: str,
        seconds: float = LEASE_SECONDS,
        clock: Callable[[], float] = time.time,
    ):
        if not _NAME.fullmatch(name):
            raise OvernightError(f"a lease's name is 1-100 characters of [A-Za-z0-9._-]: {name!r}")
        if seconds <= 0:
            raise OvernightError(f"a lease lasts a positive number of seconds, not {seconds}")
        self.name, self.what, self.seconds, self.clock = name, what, seconds, clock
        self.owner = secrets.token_hex(8)
        self._slot = _slot(Path(data_dir), f"{name}.json")
        self._version: str | None = None  # what this holder last wrote (its If-Match)
        self._holder: Holder | None = None
        self._leave: dict = {}

    def read(self) -> tuple[Holder | None, dict]:
        """The holder now (None: free, or its lease ran out) and the notes."""
        holder, notes, _ = self._read()
        return (None if holder is None or holder.gone(self.clock()) else holder), notes

    def take(self) -> None:
        """Hold it now, or raise LeaseHeld naming who does (no waiting)."""
        holder, notes, version = self._read()
        if holder is not None and holder.owner != self.owner and not holder.gone(self.clock()):
            raise LeaseHeld(self.name, holder)
        now = self.clock()
        mine = Holder(self.owner, self.what, socket.gethostname(), os.getpid(), now,
                      now + self.seconds)  # fmt: skip
        if not self._write(mine, notes, version):  # another taker won between read and write
            raced, _, _ = self._read()
            raise LeaseHeld(self.name, raced or mine)
        self._holder = mine

    def renew(self) -> None:
        """Push the lease's end a whole lease ahead; LeaseLost if it was taken over."""
        if self._holder is None:
            raise LeaseLost(f"{self.name}: renewed without being held")
        holder, notes, version = self._read()
        if holder is None or holder.owner != self.owner or version != self._version:
            self._holder = None
            who = holder.describe() if holder else "nobody"
            raise LeaseLost(f"{self.name}: the lease ran out and was taken over by {who}")
        renewed = Holder(**{**asdict(self._holder), "until": self.clock() + self.seconds})
        if not self._write(renewed, notes, version):
            self._holder = None
            raise LeaseLost(f"{self.name}: taken over while being renewed")
        self._holder = renewed

    def release(self, notes: dict | None = None) -> bool:
        """Give it back, `notes` added to (and replacing the same keys of) those kept for
        the next holder. False when it had been taken over meanwhile (nothing written)."""
        if self._holder is None:
            return False
        holder, kept, version = self._read()
        self._holder = None
        if holder is None or holder.owner != self.owner or version != self._version:
            return False
        return self._write(None, {**kept, **(notes or {})}, version)

    def leave(self, notes: dict) -> None:
        """What `held` gives back with the lease (`release`'s notes)."""
        self._leave = {**self._leave, **notes}

    @contextlib.contextmanager
    def held(self, warn: Callable[[str], None] = print) -> Iterator[Lease]:
        """Take it (LeaseHeld if another has it), renew it every third of the lease from a
        thread while the block runs, give it back after with what `leave` was given. A
        renewal that fails is said through `warn` once; the block goes on (a cycle cannot
        be stopped halfway: a lost lease is said, and the next holder resumes its run)."""
        self.take()
        stop = threading.Event()
        renewer = threading.Thread(target=self._renew_until, args=(stop, warn), daemon=True)
        renewer.start()
        try:
            yield self
        finally:
            stop.set()
            renewer.join()
            self.release(self._leave)
            self._leave = {}

    def _renew_until(self, stop: threading.Event, warn: Callable[[str], None]) -> None:
        while not stop.wait(self.seconds / 3):
            try:
                self.renew()
            except LeaseLost as e:
                warn(f"warning: {e}")
                return
            except OSError as e:  # a bucket down for a moment: the next renewal may reach it
                warn(f"warning: could not renew {self.name} ({e}); trying again")

    def _read(self) -> tuple[Holder | None, dict, str | None]:
        data, version = self._slot.read()
        if data is None:
            return None, {}, None
        try:
            found = json.loads(data)
            held = found.get("holder")
            # Fields a later version may add are left out, not taken for damage.
            holder = Holder(**{k: held[k] for k in Holder.__dataclass_fields__}) if held else None
            notes = found.get("notes") or {}
        except (ValueError, TypeError, KeyError, AttributeError):
            return None, {}, version  # a damaged lease is free: replaced whole by the next take
        return holder, notes if isinstance(notes, dict) else {}, version

    def _write(self, holder: Holder | None, notes: dict, version: str | None) -> bool:
        body = {"holder": asdict(holder) if holder else None, "notes": notes}
        data = json.dumps(body, sort_keys=True).encode()
        written = self._slot.write_if(data, version)
        if written:
            self._version = self._slot.version_of(data)
        return written


# -- where the lease is kept: a local file, or an object in the bucket ------------------


def _slot(data_dir: Path, name: str) -> _LocalSlot | _BucketSlot:
    store = segment_store(data_dir)
    return _BucketSlot(store, name) if store.remote else _LocalSlot(data_dir / LOCKS / name)


class _LocalSlot:
    """The lease as a file; a version is the hash of its bytes, compared and replaced under
    an flock of a file beside it (held for the moment of a read and a write, never while
    the lease is held: a lease outlives no process's file descriptors that way)."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> tuple[bytes | None, str | None]:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None, None
        return data, self.version_of(data)

    def write_if(self, data: bytes, version: str | None) -> bool:
        private_dir(self.path.parent)
        with self._guard():
            if self.read()[1] != version:
                return False
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            create_private(tmp)
            tmp.write_bytes(data)
            replace_durably(tmp, self.path)
        return True

    @staticmethod
    def version_of(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        fd = os.open(self.path.with_name(f".{self.path.name}.guard"), os.O_WRONLY | os.O_CREAT,
                     0o600)  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock


class _BucketSlot:
    """The lease as an object under the bucket's prefix; a version is its ETag."""

    def __init__(self, store: Any, name: str):
        self.store, self.name = store, name
        self._written: str | None = None

    def read(self) -> tuple[bytes | None, str | None]:
        return self.store.read_versioned(LOCKS, self.name)

    def write_if(self, data: bytes, version: str | None) -> bool:
        from .bucket.conditional import put_if

        tag = put_if(self.store.fs, self.store.url, self.store.key(LOCKS, self.name), data,
                     version)  # fmt: skip
        self._written = tag
        return tag is not None

    def version_of(self, _data: bytes) -> str | None:
        return self._written  # the ETag the write just made


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def _clock(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
