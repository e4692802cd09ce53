"""One cycle of a policy at a time: the lease every night and every `overnight learn` cycle
of a policy holds while it runs, and what each leaves in it for the next.

A cycle is a night of one policy (run.py's `policy_night`: score, train, gate, promote,
record); `overnight train` from cron and an `overnight learn` supervisor run the same code,
and both hold the policy's lease (storage/lease.py) `cycle-POLICY` while they do: across
the processes of a data directory and the machines that share its bucket, so two of them
never resume one interrupted run, train one group twice or race one promotion. Refused,
the night says who holds it.

What a cycle leaves in the lease's notes, `last`: when it began and ended, who ran it
(`overnight train`, `overnight learn`), why (its trigger), its run and how it ended, and,
when it promoted, how long after its groups' data was in their adapter served (`to_serving`:
the loop's latency, data to policy, as its run's record keeps it: trainer/run/record.py).
The supervisor's triggers count from it (triggers.py), on every machine alike.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator

from overnight.storage.lease import Lease

from .policies import NightOptions, PolicyNight

# The lease's name for the night before policies (policy None: every group): no policy's.
EVERY_GROUP = "every-group"


def cycle_lease(night: NightOptions, policy: str | None) -> Lease:
    """The lease of `policy`'s cycles in the night's data directory."""
    return Lease(night.data_dir, lease_name(policy), night.holder, night.lease_seconds)


def lease_name(policy: str | None) -> str:
    return f"cycle-{policy or EVERY_GROUP}"


def last_cycle(night: NightOptions, policy: str | None) -> dict | None:
    """What the policy's last cycle left (None: none yet), and nothing of who holds it."""
    return cycle_lease(night, policy).read()[1].get("last")


@contextlib.contextmanager
def one_cycle(
    night: NightOptions, policy: PolicyNight, warn: Callable[[str], None]
) -> Iterator[dict]:
    """Hold the policy's lease while the block runs (LeaseHeld, naming the holder, if
    another cycle has it); the record it yields is left in the lease as `last` at the
    end, with the outcome the block set (`run_id`, `outcome`) or the failure it raised.

    Under torchrun only the first process takes it (the others follow that one's night);
    a dry run trains nothing and takes nothing."""
    if night.dry_run or os.environ.get("RANK", "0") != "0":
        yield {}
        return
    lease = cycle_lease(night, policy.policy)
    record = {"started": time.time(), "by": night.holder, "trigger": night.trigger,
              "host": socket.gethostname(), "pid": os.getpid()}  # fmt: skip
    with lease.held(warn):
        try:
            yield record
        except BaseException as e:  # a failure, or Ctrl-C: the next cycle resumes its run
            record["outcome"] = f"failed: {type(e).__name__}: {e}"[:500]
            raise
        finally:
            record["ended"] = time.time()
            lease.leave({"last": record})


def outcome(result) -> str:
    """A night's RunResult in a few words, for the lease's record and the progress lines."""
    if not result.plan.groups:
        return "nothing to train on"
    gate = result.gate
    if result.promoted_as:
        return f"trained {len(result.plan.groups)} group(s), promoted as {result.promoted_as}"
    if gate is not None and not gate.promote:
        return f"trained {len(result.plan.groups)} group(s), the gate refused: {gate.reason}"
    return f"trained {len(result.plan.groups)} group(s), not promoted"


def promoted_line(delay: dict | None) -> str:
    if not delay:
        return ""
    return (f", serving {delay['median'] / 60:.1f} min after its data was in (median of "
            f"{delay['groups']}; at most {delay['max'] / 60:.1f})")  # fmt: skip
