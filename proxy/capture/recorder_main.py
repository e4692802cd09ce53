"""The recorder process itself (`--recorder process`; the serving side is recorder.py):
it reads batches of frames from its stdin, replays each into a Capture, builds its rows
with records.record_rows, applies --redact and writes them with a LogWriter of its own;
its health goes back on stdout, one JSON line whenever it changed.

The frames are the two sides' contract, so both are here: `frame_of` (serving side)
and `replayed` (this side).
"""

from __future__ import annotations

import argparse
import logging
import os
import pickle
import signal
import struct
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import orjson

from overnight.proxy.alias.promotions import Route
from overnight.storage import LogWriter, WriterConfig

from .attribution import Attribution
from .captures import Capture, TurnCounter
from .records import RecordFacts, record_rows
from .redact import Redactor

log = logging.getLogger("overnight.proxy")

HEADER = struct.Struct("<Q")  # a batch's length, then its pickle
IDLE_REPORT_S = 1.0  # the recorder's health, when it changed with no batch written

# -- a Capture across the pipe --------------------------------------------------------------
#
# Plain data only: pickling a Capture itself costs more than building its rows (slotted
# objects, dataclasses: ~17 µs against ~1.4 µs for a tuple of builtins). The accumulator
# is not sent: the recorder makes its own from the same recipe and gives it the same
# objects, parsed again from the upstream's bytes (`Capture.answer`).


def frame_of(capture: Capture, who: Attribution, facts: RecordFacts, turns: list[int]) -> tuple:
    """`turns`: the serving process's count for each of its rows (`TurnCounter.next`)."""
    route = capture.route
    return (
        capture.request_id,
        capture.endpoint,
        capture.stream,
        capture.request_body,
        (route.served, route.version, route.policy, route.hosted),
        capture.status,
        capture.error,
        capture.error_body,
        capture.latency_ms,
        capture.ttft_ms,
        capture.recipe,
        capture.plain,
        capture.answer,
        (who.group_id, who.rollout_id, who.source),
        (facts.started, facts.ended, facts.logged, facts.key_note, facts.hosted, facts.sent_by),
        turns,  # last: its length is the frame's number of rows
    )


def replayed(frame: tuple) -> tuple[Capture, Attribution, RecordFacts, Counted]:
    """The Capture, attribution and facts `frame_of` was given, the accumulator's state
    made again by giving a new one the same objects in the same order; and the turns."""
    request_id, endpoint, stream, body, route, status, error, error_body = frame[:8]
    latency_ms, ttft_ms, recipe, plain, answer, who, facts, turns = frame[8:]
    capture = Capture(endpoint, stream, body, Route(*route))
    capture.request_id = request_id
    capture.status, capture.error, capture.error_body = status, error, error_body
    capture.latency_ms, capture.ttft_ms = latency_ms, ttft_ms
    capture.use(*recipe)
    if plain is not None:
        capture.sent_plain(plain)
    for data in answer or ():
        capture.add(data, orjson.loads(data))
    return capture, Attribution(*who), RecordFacts(*facts), Counted(turns)


class Counted(TurnCounter):
    """The turns the serving process counted for a frame's rows, given back in order."""

    def __init__(self, turns: list[int]):
        self.turns = iter(turns)

    def next(self, rollout_id: str) -> int:
        return next(self.turns)


def record_frame(frame: tuple, writer: LogWriter, redactor: Redactor) -> None:
    """A frame's rows, built, redacted and appended to `writer` (in the recorder, or in
    the serving process for a frame that could not be handed over)."""
    capture, who, facts, turns = replayed(frame)
    rows = record_rows(capture, who, turns, writer.writer_id, facts)
    for row in redactor.apply(rows):
        writer.append("completions", row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overnight-recorder", description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--commit-interval", type=float, default=0.02)
    parser.add_argument("--roll-seconds", type=float, default=300.0)
    parser.add_argument("--redact", default=None)
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    # It stops when the pipe ends (see the module's doc), whatever the terminal says.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level = args.log_level if args.log_level in logging.getLevelNamesMapping() else "WARNING"
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s recorder: %(message)s")
    writer = LogWriter(
        WriterConfig(
            args.data, commit_interval=args.commit_interval, roll_seconds=args.roll_seconds
        )
    )
    writer.start()
    # The health lines get the pipe; anything else printed (a --redact hook's print)
    # goes to the log with the rest, not into the lines.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    reporter = _Reporter(writer, out)
    reporter.start()
    try:
        _record_all(sys.stdin.buffer, writer, Redactor(args.redact), reporter)
    finally:
        writer.close()  # commit what is queued, seal, compact
        reporter.stop()
    return 0


def _record_all(pipe, writer: LogWriter, redactor: Redactor, reporter: _Reporter) -> None:
    while True:
        head = pipe.read(HEADER.size)
        if len(head) < HEADER.size:
            return  # the serving process closed the pipe, or is gone
        data = pipe.read(HEADER.unpack(head)[0])
        try:
            batch = pickle.loads(data)
        except Exception:  # a batch cut short by a dying serving process
            log.exception("a batch of records could not be read (%d bytes)", len(data))
            return
        for frame in batch:
            try:
                record_frame(frame, writer, redactor)
            except Exception:  # a response of a shape the capture did not foresee
                log.exception("could not build the record of request %s", frame[0])
        reporter.redaction_failures = redactor.failures


class _Reporter:
    """Writes the recorder's health to the serving process, one JSON line whenever it
    changed: as soon as a batch of rows is settled (so that a recorder killed a moment
    later has reported what it wrote), else every IDLE_REPORT_S (compaction's counts),
    and once more at the end."""

    def __init__(self, writer: LogWriter, out):
        self.writer = writer
        self.out = out
        self.redaction_failures = 0
        self.settled = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="overnight-report", daemon=True)
        self.last = b""
        writer.on_settle = self.settled.set

    def start(self) -> None:
        self._send()  # up: the serving process starts serving once it has heard this
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True
        self.settled.set()
        self.thread.join()
        self._send()

    def _loop(self) -> None:
        while not self.stopped:
            self.settled.wait(IDLE_REPORT_S)
            self.settled.clear()
            self._send()

    def _send(self) -> None:
        report = asdict(self.writer.health())
        report["appended"] = self.writer.appended
        report["redaction_failures"] = self.redaction_failures
        report["writer_id"] = self.writer.writer_id
        line = orjson.dumps(report) + b"\n"
        if line == self.last:
            return
        self.last = line
        try:
            self.out.write(line)
            self.out.flush()
        except (BrokenPipeError, ValueError):  # the serving process is gone: nobody asks
            pass
