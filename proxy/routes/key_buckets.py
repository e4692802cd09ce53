"""The scoped keys' request rates: a token bucket per key with a rate (`rate` a second,
`burst` at once), one per process (`LocalBucket`), or under `overnight serve --workers N`
one per key in a small file every worker maps (mmap: `SharedBuckets`).

Without it each worker keeps its own bucket and a key gets up to N times its rate. The
supervisor makes the file (private to its user, in the temporary directory: memory-backed
on most systems, never the data directory, which may be on NFS) before it starts the
workers and names it in their environment (`BUCKETS_ENV`); it removes it when they have
stopped. A worker restarted after a crash maps the same file and finds the buckets as
they were.

An update is a read-modify-write of two doubles under an exclusive `flock` on the file:
held for microseconds, never across an await, and released by the kernel if its holder
dies, so a killed worker can leave no bucket locked. The clock is `time.monotonic()`,
CLOCK_MONOTONIC on Linux: one clock for every process of the machine. The buckets are
laid out in the keys file's order (every worker reads the same file); a header says the
layout was written (the first worker to lock writes it; later ones find it).

The concurrency cap stays per worker: a count of requests in flight held in a shared file
would stay raised forever for the requests of a worker killed mid-request (there is no
release to run), locking the key out; a rate bucket has nothing to give back.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import tempfile
import time
from pathlib import Path

from overnight.config import ProxyConfig

log = logging.getLogger("overnight.proxy")

BUCKETS_ENV = "OVERNIGHT_KEY_BUCKETS"  # set by the supervisor for its workers only
MAGIC = b"ovkb0001"  # the header: the layout below was written
SLOT = struct.Struct("=dd")  # tokens, stamp (time.monotonic)


def make_file(config: ProxyConfig) -> Path | None:
    """The supervisor's: an empty buckets file for the workers, named in the environment
    they inherit; None when no key has a rate (nothing to share)."""
    if not any(k.rate is not None for k in config.keys):
        return None
    fd, name = tempfile.mkstemp(prefix="overnight-key-buckets-")  # mode 0600
    os.close(fd)
    os.environ[BUCKETS_ENV] = name
    return Path(name)


class LocalBucket:
    """A key's bucket in this process alone."""

    __slots__ = ("rate", "size", "tokens", "stamp")

    def __init__(self, rate: float, size: int):
        self.rate, self.size = rate, size
        self.tokens, self.stamp = float(size), time.monotonic()

    def take(self) -> float:
        """0.0 when a token was taken; else the seconds until one is there (none taken)."""
        now = time.monotonic()
        self.tokens = min(self.size, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens < 1.0:
            return (1.0 - self.tokens) / self.rate
        self.tokens -= 1.0
        return 0.0


class SharedSlot:
    """A key's bucket in the workers' file: `take` as LocalBucket's."""

    __slots__ = ("buckets", "slot", "rate", "size")

    def __init__(self, buckets: SharedBuckets, slot: int, rate: float, size: int):
        self.buckets, self.slot, self.rate, self.size = buckets, slot, rate, size

    def take(self) -> float:
        return self.buckets.take(self.slot, self.rate, self.size)


class SharedBuckets:
    """The mapped file: `take(slot, rate, size)` takes a token from a key's bucket."""

    def __init__(self, path: str, sizes: list[int]):
        self.fd = os.open(path, os.O_RDWR)
        try:
            length = len(MAGIC) + SLOT.size * max(1, len(sizes))
            with _locked(self.fd):
                if os.fstat(self.fd).st_size < length:
                    os.ftruncate(self.fd, length)
                self.map = mmap.mmap(self.fd, length)
                if self.map[: len(MAGIC)] != MAGIC:  # the first worker: full buckets
                    now = time.monotonic()
                    for i, size in enumerate(sizes):
                        SLOT.pack_into(self.map, self.offset(i), float(size), now)
                    self.map[: len(MAGIC)] = MAGIC
        except BaseException:
            os.close(self.fd)
            raise

    @staticmethod
    def offset(slot: int) -> int:
        return len(MAGIC) + SLOT.size * slot

    def take(self, slot: int, rate: float, size: int) -> float:
        """0.0 when a token was taken; else the seconds until one is there (none taken).
        The lock by hand, not `_locked`: this runs on every limited request."""
        at = self.offset(slot)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            tokens, stamp = SLOT.unpack_from(self.map, at)
            now = time.monotonic()
            tokens = min(size, tokens + max(0.0, now - stamp) * rate)
            if tokens < 1.0:
                SLOT.pack_into(self.map, at, tokens, now)
                return (1.0 - tokens) / rate
            SLOT.pack_into(self.map, at, tokens - 1.0, now)
            return 0.0
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


@contextlib.contextmanager
def _locked(fd: int):
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def buckets_for(config: ProxyConfig) -> list[LocalBucket | SharedSlot | None]:
    """Each key's bucket, in the keys file's order (None: no rate): shared under --workers
    N with the supervisor's file, else this process's own, as when the file cannot be
    mapped (the log says so: a limit never stops a proxy)."""
    rates = [(k.rate, k.bucket) for k in config.keys]
    own = [None if rate is None else LocalBucket(rate, size) for rate, size in rates]
    path = os.environ.get(BUCKETS_ENV)
    rated = [(i, rate, size) for i, (rate, size) in enumerate(rates) if rate is not None]
    if config.workers < 2 or not path or not rated:
        return own
    try:
        shared = SharedBuckets(path, [size for _, _, size in rated])
    except OSError as e:
        log.error("key rates: could not map %s (%s); each worker limits on its own", path, e)
        return own
    for slot, (i, rate, size) in enumerate(rated):
        own[i] = SharedSlot(shared, slot, rate, size)
    return own
