"""`--recorder process`, the serving side: completion records built and written by a
child process (recorder_main.py), on another core.

A completion's record (its rows, `--redact`, the write-ahead log's encoding and fsync)
costs the serving process a third of what forwarding it does (BENCHMARKS.md, issue 24).
With `--recorder process` the serving process hands each finished exchange to a child
process instead, which builds the rows with the same code (records.record_rows) and
writes them with a LogWriter of its own:

  serving process                                   recorder process (recorder_main.py)
  _record: metrics observed, then                   reads a batch, unpickles it, replays
  RecorderProcess.record(capture, who, facts)  -->  each Capture, record_rows, --redact,
  (frame_of: plain data, the upstream's bytes)      LogWriter.append
  a batch every BATCH_S: one pickle, one write      its health back once per commit   -->
  /health, /admin/stats, /metrics add its health    the serving process's view of it

Why a batch: a pipe write that wakes the reader on the other core costs the writer
~15 µs, one per request cost more than the record did; one per BATCH_S is nothing.
Why replay: the child gives an accumulator of its own the objects the serving one was
given, parsed again from the upstream's bytes, and builds its rows with the same code:
one code path for records (tests/test_recorder.py compares the two processes' rows).
The pipe is the serving process's own, to its own child; nothing else can write to it.

The price: the child parses each answer again and pays the pipe, so the record costs
more CPU in all; the serving core saves what the record cost it only where another core
has room for the child. Measured on two cores, where the other one runs the load
generator and the upstream, it is slower than recording inline (BENCHMARKS.md), which
is why it is not the default.

What changes, and what does not:
- Rewards, finishes and shadow siblings stay in the serving process's writer, durable
  before they are answered. A completion is committed by the recorder within about
  BATCH_S + `--commit-interval` of its answer, as before within `--commit-interval`,
  so a reward may be on disk a few ms before the completion it rewards.
- Shadow sampling and tracing need the rows in the serving process (siblings are asked
  for from them; a span ends with them): with either on, records are built there, as
  with `--recorder inline`.
- The recorder dies: it is started again (backoff up to MAX_BACKOFF_S), records wait
  for it in a bounded queue, and those it had read but not written are counted lost;
  recording is "degraded" meanwhile. The serving process stops: the pipe is closed
  and the recorder writes what it has, seals and compacts its log. Killed, even with
  SIGKILL: the recorder reads to the end of the pipe and does the same.
- The recorder ignores SIGINT and SIGTERM (a terminal's Ctrl-C reaches the whole
  process group): it stops when the pipe ends, so no record is cut off mid-way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import orjson
from aiohttp import web

from overnight.storage import LogWriter, WriterHealth

from .attribution import Attribution
from .captures import Capture, TurnCounter
from .recorder_main import HEADER, frame_of
from .records import RecordFacts
from .redact import Redactor

log = logging.getLogger("overnight.proxy")

MODULE = "overnight.proxy.capture.recorder_main"
# `-c`, not `-m`: the package imports this module already (runpy would run a second copy).
ENTRY = f"import sys; from {MODULE} import main; sys.exit(main(sys.argv[1:]))"
BATCH_S = 0.005  # records waiting at most this long for their batch's write
# Records waiting while the recorder is behind or down, at most: past this, new ones
# are counted lost (a full disk is the writer's; this is a recorder that cannot keep up).
MAX_WAITING = 10_000
MAX_WAITING_BYTES = 256 * 1024 * 1024  # of the upstream's answers those records hold
MAX_PIPE_BYTES = 256 * 1024 * 1024  # written to the pipe, not yet read by the recorder
MAX_BACKOFF_S = 30.0
CLOSE_TIMEOUT_S = 600.0  # the recorder's last commit, seal and compaction

# The health counters that add up over the recorder's lifetimes and the serving writer
# (files_quarantined is not one: both writers count the same directory, now).
COUNTERS = tuple(
    f.name for f in fields(WriterHealth) if f.type in (int, "int") and f.name != "files_quarantined"
)


class RecorderProcess:
    """The serving side: batches finished Captures to the recorder, keeps it running,
    and knows its health."""

    def __init__(
        self,
        command: list[str],
        turns: TurnCounter,
        inline: Callable[[tuple], None] | None = None,
    ):
        self.command = command
        # The rollouts' turns are counted here, as inline: a recorder started again
        # must not count a rollout's turns from 0 again.
        self.turns = turns
        self.inline = inline  # records a frame that cannot cross the pipe, here
        self.waiting: list[tuple] = []  # frames (`frame_of`)
        self.waiting_rows = 0
        self.waiting_bytes = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.flush_handle: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None
        self.closing = False
        self.sent_rows = 0  # to the recorder running now
        self.report: dict = {}  # its latest health line
        self.earlier: dict[str, int] = dict.fromkeys(COUNTERS, 0)  # recorders that died
        self.appended_earlier = 0
        self.redaction_earlier = 0
        self.rows_dropped = 0  # never reached a recorder: the queue was full, or it died
        self.down: tuple[str, float] | None = None  # why no recorder runs, since when
        self.restarts = 0

    @classmethod
    def for_config(
        cls, config, turns: TurnCounter, inline: Callable[[tuple], None] | None = None
    ) -> RecorderProcess:
        command = [sys.executable, "-c", ENTRY, "--data", str(config.data_dir)]
        command += ["--commit-interval", str(config.commit_interval)]
        command += ["--roll-seconds", str(config.roll_seconds)]
        if config.redact:
            command += ["--redact", config.redact]
        command += ["--log-level", logging.getLevelName(logging.getLogger().level)]
        return cls(command, turns, inline)

    # -- the hot path --------------------------------------------------------------------

    def record(self, capture: Capture, who: Attribution, facts: RecordFacts) -> None:
        rows = len(capture.acc.choices) or 1
        turns = [self.turns.next(r) for _, r in who.rows(capture.request_id, rows)]
        size = sum(map(len, capture.answer or ()))
        if self.closing:
            self._drop(rows, "a record came after the proxy began to stop")
            return
        if len(self.waiting) >= MAX_WAITING or self.waiting_bytes + size > MAX_WAITING_BYTES:
            self._drop(rows, f"the recorder is behind: {len(self.waiting)} records waiting")
            return
        self.waiting.append(frame_of(capture, who, facts, turns))
        self.waiting_rows += rows
        self.waiting_bytes += size
        if self.flush_handle is None:
            self.flush_handle = asyncio.get_running_loop().call_later(BATCH_S, self._flush)

    def _flush(self) -> None:
        self.flush_handle = None
        proc = self.proc
        if not self.waiting or proc is None or proc.stdin is None or proc.stdin.is_closing():
            return  # kept until a recorder runs again (`_run`)
        batch, rows = self.waiting, self.waiting_rows
        self.waiting, self.waiting_rows, self.waiting_bytes = [], 0, 0
        if proc.stdin.transport.get_write_buffer_size() > MAX_PIPE_BYTES:
            self._drop(rows, "the recorder is behind: its pipe is full")
            return
        data, left_out = _pickled(batch)
        for frame in left_out:  # too deep for pickle (JSON nested ~500 levels): here
            rows -= len(frame[-1])
            self._record_here(frame)
        proc.stdin.write(HEADER.pack(len(data)) + data)
        self.sent_rows += rows

    def _record_here(self, frame: tuple) -> None:
        if self.inline is None:
            self._drop(len(frame[-1]), f"request {frame[0]} could not be handed over")
            return
        try:
            self.inline(frame)
        except Exception:
            log.exception("could not record request %s", frame[0])
            self._drop(len(frame[-1]), f"request {frame[0]} could not be recorded")

    def _drop(self, rows: int, why: str) -> None:
        if not self.rows_dropped:
            log.error("records lost: %s", why)
        self.rows_dropped += rows
        self.down = self.down or (why, time.time())

    # -- the recorder's life -------------------------------------------------------------

    async def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name="overnight-recorder")
        # Up and writing before the first request is served.
        for _ in range(200):
            if self.report or self.down:  # up, or down with a reason /health gives
                return
            await asyncio.sleep(0.05)
        log.warning("the recorder process has not reported after 10 s; serving anyway")

    async def _run(self) -> None:
        backoff = 0.5
        while not self.closing:
            started = time.monotonic()
            try:
                # stdout: the health lines; stderr: the serving process's own log.
                self.proc = await asyncio.create_subprocess_exec(
                    *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
                )
            except OSError as e:
                self._went_down(f"cannot start the recorder process: {e}")
            else:
                self._flush()  # what waited for it
                try:
                    code: object = await self._follow(self.proc)
                except Exception as e:  # a bug of ours: it must not end the restarts
                    log.exception("lost track of the recorder process")
                    with contextlib.suppress(ProcessLookupError):
                        self.proc.kill()
                    code = f"unknown ({e!r})"
                if self.closing:
                    return
                self._went_down(f"the recorder process exited with code {code}")
            if time.monotonic() - started > 60:  # it ran a while: a new fault, a new backoff
                backoff = 0.5
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            self.restarts += 1

    async def _follow(self, proc: asyncio.subprocess.Process) -> int:
        assert proc.stdout is not None
        async for line in proc.stdout:
            try:
                self.report = orjson.loads(line)
            except ValueError:
                log.warning("the recorder said something unreadable: %r", line[:200])
                continue
            self.down = None  # a recorder runs; its own reason, if any, is in the report
        return await proc.wait()

    def _went_down(self, why: str) -> None:
        """The recorder is gone: what it had and had not written is lost (as a crash
        of the serving process would lose it); its counts are kept."""
        self.proc = None
        # Rows it wrote to its log but had not reported are counted lost here, and are
        # still recovered from that log by the next start: the count errs towards loss.
        settled = int(self.report.get("rows_written", 0)) + int(self.report.get("rows_lost", 0))
        lost = max(0, self.sent_rows - settled)
        for name in COUNTERS:
            self.earlier[name] += int(self.report.get(name, 0))
        self.appended_earlier += settled  # the rest are in rows_dropped: counted once
        self.redaction_earlier += int(self.report.get("redaction_failures", 0))
        self.rows_dropped += lost
        self.report, self.sent_rows = {}, 0
        log.error("%s; %d records it had not written are lost; starting it again", why, lost)
        self.down = (f"{why}; starting it again", time.time())

    async def close(self) -> None:
        """The last batch written, the pipe closed, and the recorder's log committed,
        sealed and compacted before this returns."""
        self.closing = True
        if self.flush_handle is not None:
            self.flush_handle.cancel()
        self._flush()
        if self.waiting:
            self._drop(self.waiting_rows, "the proxy stopped while no recorder ran")
        proc = self.proc
        if proc is None and self.task is not None:  # waiting to start one again: not now
            self.task.cancel()
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
                await asyncio.wait_for(proc.stdin.wait_closed(), CLOSE_TIMEOUT_S)
        if self.task is not None:
            try:
                await asyncio.wait_for(self.task, CLOSE_TIMEOUT_S)
            except asyncio.CancelledError:
                if self.task.cancelled() and asyncio.current_task().cancelling() == 0:
                    return  # the one cancelled above
                raise
            except TimeoutError:  # (before Exception: it is one)
                log.error("the recorder did not finish within %g s; stopping it", CLOSE_TIMEOUT_S)
                if self.proc is not None:
                    self.proc.kill()
            except Exception:  # the serving writer must still be closed after this
                log.exception("the recorder's supervisor failed")

    # -- what it reports -----------------------------------------------------------------

    def snapshot(self) -> dict:
        return {
            "pid": self.proc.pid if self.proc is not None else None,
            "writer_id": self.report.get("writer_id"),
            "restarts": self.restarts,
            "rows_dropped": self.rows_dropped,
        }

    @property
    def appended(self) -> int:
        """Rows handed to a recorder's writer, and those lost before they reached one."""
        return self.appended_earlier + int(self.report.get("appended", 0)) + self.rows_dropped

    @property
    def redaction_failures(self) -> int:
        return self.redaction_earlier + int(self.report.get("redaction_failures", 0))

    def health(self) -> WriterHealth:
        counts = {n: self.earlier[n] + int(self.report.get(n, 0)) for n in COUNTERS}
        counts["rows_lost"] += self.rows_dropped
        counts["files_quarantined"] = int(self.report.get("files_quarantined", 0))
        reason, since = self.down or (self.report.get("reason"), self.report.get("since"))
        if reason is None and not self.report:
            reason, since = "the recorder process has not started yet", None
        return WriterHealth(
            status="ok" if reason is None else "degraded", reason=reason, since=since, **counts
        )


def _pickled(batch: list[tuple]) -> tuple[bytes, list[tuple]]:
    """The batch as one pickle, and the frames left out of it: those pickle refuses (a
    request body nested deeper than its recursion allows, which JSON parsers accept)."""
    try:
        return pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL), []
    except (RecursionError, pickle.PicklingError, TypeError):
        kept, left_out = [], []
        for frame in batch:
            try:
                pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
                kept.append(frame)
            except (RecursionError, pickle.PicklingError, TypeError):
                left_out.append(frame)
        return pickle.dumps(kept, protocol=pickle.HIGHEST_PROTOCOL), left_out


@dataclass(frozen=True, slots=True)
class Recording:
    """What records in a serving process, as /health, /admin/stats and /metrics report
    it: its writer (rewards, finishes, siblings; and completions with no recorder), its
    recorder process if it has one, and the --redact hook's failures in either."""

    writer: LogWriter
    recorder: RecorderProcess | None
    redactor: Redactor

    def health(self) -> WriterHealth:
        """Counts added; degraded if either writer is (the serving writer's reason first:
        rewards are refused while it fails)."""
        a = self.writer.health()
        if self.recorder is None:
            return a
        b = self.recorder.health()
        first = a if a.status != "ok" else b
        counts = {n: getattr(a, n) + getattr(b, n) for n in COUNTERS}
        counts["files_quarantined"] = max(a.files_quarantined, b.files_quarantined)
        return WriterHealth(status=first.status, reason=first.reason, since=first.since, **counts)

    @property
    def appended(self) -> int:
        return self.writer.appended + (self.recorder.appended if self.recorder else 0)

    @property
    def redaction_failures(self) -> int:
        return self.redactor.failures + (self.recorder.redaction_failures if self.recorder else 0)


RECORDER = web.AppKey("recorder", RecorderProcess)
