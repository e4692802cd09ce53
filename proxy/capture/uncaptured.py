"""Model output the proxy forwards but does not record: counted, warned of, shown.

The pass-through (relay.passthrough) forwards vLLM's other inference routes so that an
agent works through the proxy as it does directly. Those that generate text an agent
could be trained on, but that the proxy does not capture, must not pass in silence: an
agent on them would run fine and leave no training data. Each such POST answered
successfully is counted per path (`/admin/stats`, `/ui`) and logged once per path at
WARNING.
"""

from __future__ import annotations

import logging

from aiohttp import web

log = logging.getLogger("overnight.proxy")

# POST routes of vLLM 0.32 whose answer is generated text that no capture records.
# (Chat and text completions, Responses and Messages are captured: agent_api.py.)
GENERATING = frozenset({"audio/transcriptions", "audio/translations"})


class Uncaptured:
    """Per path: how many successful POSTs produced model output that was not recorded."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def note(self, tail: str) -> None:
        if tail not in self.counts:
            log.warning(
                "POST /v1/%s produces model output that the proxy forwards but does not "
                "record (no training data); counted in /admin/stats 'uncaptured'",
                tail,
            )
        self.counts[tail] = self.counts.get(tail, 0) + 1

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)


UNCAPTURED = web.AppKey("uncaptured", Uncaptured)


def note_passthrough(app: web.Application, method: str, tail: str, status: int) -> None:
    """Count a forwarded request if it produced model output the proxy did not record."""
    if method == "POST" and status < 400 and tail in GENERATING:
        app[UNCAPTURED].note(tail)
