"""Record ids and timestamps, the same for every part that writes rows."""

from __future__ import annotations

import itertools
import os
import time

# A random per-process prefix and a counter: unique across processes (48 random bits
# each) at a fraction of uuid4's cost, which reads the OS's entropy every call.
_PREFIX = os.urandom(6).hex()
_COUNTER = itertools.count()


def new_id() -> str:
    return f"{_PREFIX}{next(_COUNTER):010x}"


def now_us() -> int:
    """Microseconds since the epoch, UTC: the unit of every timestamp column."""
    return time.time_ns() // 1000
