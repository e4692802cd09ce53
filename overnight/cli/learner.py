"""`overnight serve --learn`: one box that serves and learns. Beside the proxy, a child
`overnight learn` (cli/learn.py: the supervisor that runs a cycle whenever a trigger
fires) on the same data directory, promoting through this proxy.

Its lifetime follows the proxy's:

  start     once the proxy answers /health (a cycle asks the proxy whose groups are
            whose and what it serves), with the operator's `--learn` options and
            `--data`, `--proxy` added; the admin token through the environment, never
            on a command line other users can read
  meanwhile its lines are this process's (stdout); a learner that dies of a signal not
            ours (the kernel's OOM killer) is started again after a pause (RESTART_S,
            doubled each time), since its killed cycle resumes at the next start, and
            not after MAX_KILLS kills within an hour (its resumed cycle would only be
            killed again); one that exits of itself (its --max-cycles done, `overnight
            learn --stop`) is not
  stop      first, while the proxy still serves (a cycle may be waking vLLM through it):
            SIGTERM to its process group (the supervisor gives back its cycle's lease; the
            run, checkpointed every step, is resumed by the next start), then SIGKILL if
            it has not exited in STOP_S; then the proxy's own shutdown

It runs in its own session, so a terminal's Ctrl-C reaches `overnight serve` alone, which
then stops it in that order; and it gets SIGTERM when serve dies however it dies
(SIGKILL, the OOM killer), so that no learner outlives its serve to meet the next one's.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from overnight.errors import ConfigError

log = logging.getLogger("overnight")

STOP_S = 60.0  # a cycle interrupted mid-step exits in seconds; then SIGKILL
RESTART_S = 10.0  # the pause before a killed learner is started again, doubled each time
MAX_KILLS, KILLS_WINDOW_S = 3, 3600.0  # more kills than this in the window: not again
READY_S = 600.0  # how long it waits for the proxy to answer (vLLM's start comes first)
# Given by `serve` itself: the same options in --learn would point the learner elsewhere.
OWN = ("--data", "--local-dir", "--proxy", "--admin-token")
# Commands to a running learner, each its own short `overnight learn` run, not a learner.
COMMANDS = ("--now", "--pause", "--resume", "--stop", "--status")


def learn_arguments(options: str) -> list[str]:
    """`--learn`'s text as `overnight learn` arguments, checked as that command parses
    them (a bad one fails here, before vLLM starts); the ones serve gives, and the
    commands to a running learner, refused."""
    import click

    from .learn import check_learning, learn

    try:
        args = shlex.split(options)
    except ValueError as e:
        raise ConfigError(f"--learn: {e}") from None
    names = [a.split("=", 1)[0] for a in args]
    if given := [n for n in names if n in OWN]:
        raise ConfigError(f"--learn: {', '.join(given)} is serve's to give (its --data, "
                          "this proxy, its --admin-token)")  # fmt: skip
    if asked := [n for n in names if n in COMMANDS]:
        raise ConfigError(f"--learn: {', '.join(asked)} is a command to a running learner: "
                          f"`overnight learn {asked[0]} --data DATA` beside this serve")  # fmt: skip
    try:
        ctx = learn.make_context("learn", [*args, "--data", ".", "--proxy", "http://127.0.0.1:1"])
        check_learning(ctx.params)
    except click.exceptions.Exit:  # --help
        raise ConfigError("--learn: give `overnight learn`'s options, not --help") from None
    except click.ClickException as e:
        raise ConfigError(f"--learn: {e.format_message()}") from None
    return args


class Learner:
    """The `overnight learn` child of one `overnight serve`."""

    def __init__(
        self, options: str, data_dir: Path, proxy_url: str, admin_token: str | None = None
    ) -> None:
        self.args = learn_arguments(options)
        self.data_dir, self.proxy_url, self.admin_token = data_dir, proxy_url, admin_token
        self.process: subprocess.Popen | None = None
        self.kills: list[float] = []  # when it was killed by a signal not ours
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # a start and a stop never cross
        self._thread: threading.Thread | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "overnight.cli", "learn", "--data", str(self.data_dir),
                "--proxy", self.proxy_url, *self.args]  # fmt: skip

    def start(self) -> None:
        """Start it once the proxy answers, in a thread (the proxy's loop is the caller's)."""
        self._thread = threading.Thread(target=self._keep, name="learner", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        if not self._wait_ready():
            return
        while not self._stopping.is_set():
            try:
                code = self._run_once()
            except Exception as e:  # Popen out of memory or processes: as a kill
                log.error("the learner could not start: %s: %s", type(e).__name__, e)
                code = -1
            if code is None or self._stopping.is_set():
                return
            if code >= 0:  # it ended of itself: stopped, its cycles done, or refused
                log.log(logging.INFO if code == 0 else logging.ERROR,
                        "the learner exited (code %s): serving goes on without it", code)  # fmt: skip
                return
            now = time.monotonic()
            self.kills = [t for t in self.kills if now - t < KILLS_WINDOW_S] + [now]
            if len(self.kills) > MAX_KILLS:  # its resumed cycle is killed again and again
                log.error("the learner was killed %d times in %g min: not starting it again; "
                          "serving goes on (see the learner's last lines for its cycle)",
                          len(self.kills), KILLS_WINDOW_S / 60)  # fmt: skip
                return
            pause = RESTART_S * 2 ** (len(self.kills) - 1)
            log.error("the learner was killed (signal %s): starting it again in %g s "
                      "(its cycle resumes)", -code, pause)  # fmt: skip
            self._stopping.wait(pause)

    def _run_once(self) -> int | None:
        """One learner process, until it exits: its exit code (None: stopped first)."""
        env = dict(os.environ)
        if self.admin_token:
            env["OVERNIGHT_ADMIN_TOKEN"] = self.admin_token
        with self._lock:
            if self._stopping.is_set():
                return None
            # Its own session (a terminal's Ctrl-C reaches serve alone), and SIGTERM when
            # serve dies however it dies (SIGKILL, the OOM killer): never a second learner.
            command = [sys.executable, "-c", _WITH_PARENT, str(os.getpid()), *self.command()]
            self.process = subprocess.Popen(command, env=env, start_new_session=True)
            log.info("learning beside the proxy (pid %s): %s", self.process.pid,
                     shlex.join(self.command()[2:]))  # fmt: skip
        return self.process.wait()

    def _wait_ready(self) -> bool:
        # The proxy is local: no HTTP proxy of the environment between them.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + READY_S
        while not self._stopping.is_set() and time.monotonic() < deadline:
            try:
                with opener.open(self.proxy_url + "/health", timeout=5):
                    return True
            except (OSError, http.client.HTTPException):
                self._stopping.wait(0.5)
        if not self._stopping.is_set():
            log.error("the proxy did not answer at %s in %g s: not learning", self.proxy_url,
                      READY_S)  # fmt: skip
        return False

    def stop(self) -> None:
        """SIGTERM to its process group, then SIGKILL after STOP_S; no restart after
        this. A second call (a second Ctrl-C) leaves the first one's stop alone."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            process = self.process
        if process is not None and process.poll() is None:
            log.info("stopping the learner (pid %s)", process.pid)
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(STOP_S)
            except subprocess.TimeoutExpired:
                log.error("the learner did not stop in %g s: killed", STOP_S)
                _signal_group(process, signal.SIGKILL)
                process.wait()
        if self._thread is not None:
            self._thread.join(STOP_S)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    """To the learner and whatever it started (it leads its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


# The learner's first lines, before it becomes `overnight learn` (execv keeps the setting):
# SIGTERM when its parent dies (Linux's prctl PR_SET_PDEATHSIG), and no start at all when
# the parent died already. Not a preexec_fn: forking from a threaded process runs none.
_WITH_PARENT = """
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
os.execv(sys.argv[2], sys.argv[2:])
"""
