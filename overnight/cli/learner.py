"""`overnight serve --learn`: one box that serves and learns. Beside the proxy, a child
`overnight learn` (cli/learn.py: the supervisor that runs a cycle whenever a trigger
fires) on the same data directory, promoting through this proxy.

Its lifetime follows the proxy's:

  start     once the proxy answers /health (a cycle asks the proxy whose groups are
            whose and what it serves), with the operator's `--learn` options and
            `--data`, `--proxy` added; the admin token through the environment, never
            on a command line other users can read
  meanwhile its lines are this process's (stdout); a learner that dies of a signal not
            ours (the kernel's OOM killer) is started again after a pause, since its
            killed cycle resumes at the next start; one that exits of itself (its
            --max-cycles done, `overnight learn --stop`, an error in its options) is not
  stop      first, before the proxy stops: SIGTERM (the supervisor gives back its cycle's
            lease; the run, checkpointed every step, is resumed by the next start), then
            SIGKILL if it has not exited in STOP_S

It runs in its own session, so a terminal's Ctrl-C reaches `overnight serve` alone, which
then stops it in that order.
"""

from __future__ import annotations

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
RESTART_S = 10.0  # the pause before a killed learner is started again
READY_S = 600.0  # how long it waits for the proxy to answer (vLLM's start comes first)
# Given by `serve` itself: the same options in --learn would point the learner elsewhere.
OWN = ("--data", "--proxy", "--admin-token")
# Commands to a running learner, each its own short `overnight learn` run, not a learner.
COMMANDS = ("--now", "--pause", "--resume", "--stop", "--status")


def learn_arguments(options: str) -> list[str]:
    """`--learn`'s text as `overnight learn` arguments, checked as that command parses
    them (a bad one fails here, before vLLM starts); the ones serve gives, and the
    commands to a running learner, refused."""
    import click

    from .learn import learn

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
        learn.make_context("learn", [*args, "--data", ".", "--proxy", "http://127.0.0.1:1"])
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
            env = dict(os.environ)
            if self.admin_token:
                env["OVERNIGHT_ADMIN_TOKEN"] = self.admin_token
            with self._lock:
                if self._stopping.is_set():
                    return
                self.process = subprocess.Popen(self.command(), env=env, start_new_session=True)
                log.info("learning beside the proxy (pid %s): %s", self.process.pid,
                         shlex.join(self.command()[2:]))  # fmt: skip
            code = self.process.wait()
            if self._stopping.is_set():
                return
            if code >= 0:  # it ended of itself: stopped, its cycles done, or refused
                log.log(logging.INFO if code == 0 else logging.ERROR,
                        "the learner exited (code %s): serving goes on without it", code)  # fmt: skip
                return
            log.error("the learner was killed (signal %s): starting it again in %g s "
                      "(its cycle resumes)", -code, RESTART_S)  # fmt: skip
            self._stopping.wait(RESTART_S)

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + READY_S
        while not self._stopping.is_set() and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.proxy_url + "/health", timeout=5):
                    return True
            except OSError:
                self._stopping.wait(0.5)
        if not self._stopping.is_set():
            log.error("the proxy did not answer at %s in %g s: not learning", self.proxy_url,
                      READY_S)  # fmt: skip
        return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_S; no restart after this."""
        with self._lock:
            self._stopping.set()
            process = self.process
        if process is not None and process.poll() is None:
            log.info("stopping the learner (pid %s)", process.pid)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(STOP_S)
            except subprocess.TimeoutExpired:
                log.error("the learner did not stop in %g s: killed", STOP_S)
                process.kill()
                process.wait()
        if self._thread is not None:
            self._thread.join(STOP_S)
