"""A colocated night: vLLM asleep, through the proxy, while training and the gate hold the GPU.

`--colocate auto` (the default) colocates when the proxy says it launched vLLM on this
machine with its sleep routes and the trainer will train on a GPU; `on` always (the CPU
tests), `off` never. The window (proxy/vllm_sleep.py) is a lease: a thread here
renews it while the night trains, and a night that dies stops renewing, so the proxy
wakes vLLM itself when the lease runs out. The window ends (vLLM awake) before the new
adapter is promoted, whatever happened meanwhile.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from overnight.errors import OvernightError

from .proxy_client import admin_call


def should_colocate(mode: str, state: dict, on_gpu: bool, say=print) -> bool:
    """Whether tonight sleeps vLLM: the mode, what the proxy says, where training runs."""
    if mode == "off":
        return False
    if mode == "on":
        return True
    where = state.get("colocation") or {}
    here = where.get("launched_vllm") and where.get("host") == socket.gethostname()
    if here and on_gpu and not where.get("vllm_sleeps"):
        say("warning: vLLM runs on this GPU without its sleep routes (serve --no-sleep-mode): "
            "training shares the card with it")  # fmt: skip
    return bool(here and on_gpu and where.get("vllm_sleeps"))


@dataclass
class WindowRecord:
    """What the run records of its window (`metrics.maintenance`)."""

    seconds: float | None = None
    held: int = 0
    refused: int = 0
    began_at: float | None = None
    renewals: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "errors" or v}


@contextlib.contextmanager
def window(
    proxy_url: str, token: str | None, holder: str, lease: float, say=print
) -> Iterator[WindowRecord]:
    """vLLM asleep inside the block, awake after it (on an error too)."""
    record = WindowRecord(began_at=time.time())
    payload = {"holder": holder, "lease_seconds": lease}
    say(f"maintenance: draining the proxy and putting vLLM to sleep (lease {lease:g} s)")
    admin_call(proxy_url, "/admin/maintenance", token, {"action": "begin", **payload})
    stop = threading.Event()
    renewer = threading.Thread(
        target=_renew, args=(proxy_url, token, payload, stop, record), daemon=True
    )
    renewer.start()
    try:
        yield record
    finally:
        stop.set()
        renewer.join()
        ended = _end(proxy_url, token, holder, record)
        last = (ended or {}).get("last") or {}
        record.seconds = last.get("seconds", time.time() - record.began_at)
        record.held, record.refused = last.get("held", 0), last.get("refused", 0)
        say(f"maintenance: vLLM awake after {record.seconds:.1f} s; {record.held} request(s) "
            f"held, {record.refused} answered 503")  # fmt: skip


def _renew(proxy_url, token, payload: dict, stop: threading.Event, record: WindowRecord) -> None:
    """Renew at a third of the lease, so that two lost renewals still leave it held."""
    while not stop.wait(payload["lease_seconds"] / 3):
        try:
            admin_call(proxy_url, "/admin/maintenance", token, {"action": "renew", **payload})
            record.renewals += 1
        except OvernightError as e:  # the proxy restarted? it woke vLLM; training goes on
            record.errors.append(str(e)[:300])


def _end(proxy_url: str, token: str | None, holder: str, record: WindowRecord) -> dict | None:
    for attempt in range(3):
        try:
            return admin_call(proxy_url, "/admin/maintenance", token,
                              {"action": "end", "holder": holder})  # fmt: skip
        except OvernightError as e:
            record.errors.append(str(e)[:300])
            time.sleep(1 + attempt)
    # The proxy wakes vLLM itself when the lease runs out: the promotion then waits for it.
    return None
