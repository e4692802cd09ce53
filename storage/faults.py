"""Where the crash tests kill the store: named points in compaction, merge and prune.

`kill_point(stage)` does nothing unless the environment variable `OVERNIGHT_KILL_AT`
names the stage (the trainer's kill points, trainer/run/checkpoint.py, read the same
variable): `STAGE` kills this process with SIGKILL, as a power cut would;
`STAGE:parent` kills only its parent, in a compaction child (compactor.py names its
parent in `OVERNIGHT_CHILD_OF`; anywhere else it does nothing), and goes on, after
`OVERNIGHT_KILL_PAUSE` seconds, as an orphan; `STAGE:group` kills the whole process
group. tests/test_crash_consistency.py restarts the store after each and
counts what survived. The stages:

    segment-written   compaction: a segment written to its temporary name, not renamed
    log-compacted     compaction: every segment published, the log not yet deleted
    merge-writing     a merged file written to its temporary name, not renamed
    merge-written     a merged file in place, the manifest not committed
    merge-committed   the manifest committed, nothing it replaces deleted yet
    cleanup-deleting  replaced files deleted, the manifest that drops them not written
    prune-renamed     a pruned day renamed out of view, not yet deleted

Imports nothing of overnight's: every module of storage may mark a point.
"""

from __future__ import annotations

import os
import signal
import time

KILL_AT_ENV = "OVERNIGHT_KILL_AT"
PAUSE_ENV = "OVERNIGHT_KILL_PAUSE"
CHILD_ENV = "OVERNIGHT_CHILD_OF"  # set by compactor.py: the pid of the child's parent


def kill_point(stage: str) -> None:
    """Die here (or kill the parent, or the group) when `OVERNIGHT_KILL_AT` says so."""
    wanted = os.environ.get(KILL_AT_ENV)
    if not wanted or wanted.partition(":")[0] != stage:
        return
    who = wanted.partition(":")[2]
    if who == "parent":
        if os.environ.get(CHILD_ENV) != str(os.getppid()):
            return  # not a compaction child: its parent may be anything (a test runner)
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(float(os.environ.get(PAUSE_ENV) or 0))  # a restart races with us
        return
    if who == "group":
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
