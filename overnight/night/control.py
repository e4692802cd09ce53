"""What an operator tells the `overnight learn` supervisors of a data directory: files in
DATA/learn/, written by `overnight learn --now/--pause/--resume/--stop` and read by every
supervisor on that directory before each round (about once a second while it waits).

  now-POLICY    {"at": time}: run POLICY's cycle at once (`now`: every policy's); asked
                until a cycle of the policy begins after `at`, whoever runs it
  pause-POLICY  start no cycle of POLICY until resumed (`pause`: of any policy); a cycle
                running meanwhile finishes
  stop          {"at": time}: every supervisor started before `at` stops, once its running
                cycle (if any) has finished; one started later ignores it

The files are the local data directory's: with a bucket, they reach the supervisors of
this machine (each machine's supervisor is told on its own machine); the cycle lease is
what all machines share. A policy's name is a file name's part: [A-Za-z0-9._-], as the
proxy requires of its aliases.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

from overnight.errors import ConfigError
from overnight.storage.files import create_private, private_dir, replace_durably

LEARN = "learn"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


class Control:
    """DATA/learn/'s commands, for one data directory."""

    def __init__(self, data_dir: Path):
        self.dir = Path(data_dir) / LEARN

    # -- what `overnight learn --now/--pause/--resume/--stop` write ----------------------

    def ask_now(self, policy: str | None) -> Path:
        return self._stamp(_file("now", policy))

    def pause(self, policy: str | None) -> Path:
        return self._touch(_file("pause", policy))

    def resume(self, policy: str | None) -> list[Path]:
        """Lift `policy`'s pause (None: every pause, each policy's and the general one)."""
        names = [_file("pause", policy)] if policy else [p.name for p in self._each("pause")]
        gone = []
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                (self.dir / name).unlink()
                gone.append(self.dir / name)
        return gone

    def stop(self) -> Path:
        return self._stamp("stop")

    # -- what a supervisor reads -------------------------------------------------------

    def asked(self, policy: str | None, last_started: float | None) -> bool:
        """Whether a cycle of `policy` was asked for after its last cycle began
        (`last_started`, from its lease: None, never): an ask is answered by the first
        cycle that begins after it, whichever supervisor (or cron night) runs it."""
        for name in (_file("now", policy), "now"):
            at = self._time_in(name)
            if at is not None and (last_started is None or at > last_started):
                return True
        return False

    def paused(self, policy: str | None) -> bool:
        return (self.dir / "pause").exists() or (self.dir / _file("pause", policy)).exists()

    def stop_asked(self, started: float) -> bool:
        """Whether a stop was asked after a supervisor started at `started` began."""
        at = self._time_in("stop")
        return at is not None and at >= started

    def stamp(self) -> tuple:
        """The commands as they stand (names and times): a change means a new one."""
        seen = []
        for path in self.dir.iterdir() if self.dir.is_dir() else ():
            with contextlib.suppress(FileNotFoundError):  # a pause lifted meanwhile
                if not path.name.startswith("."):  # a command being written
                    seen.append((path.name, path.stat().st_mtime_ns))
        return tuple(sorted(seen))

    def _stamp(self, name: str) -> Path:
        """`name` written whole with the time now (renamed into place: never half read)."""
        private_dir(self.dir)
        path = self.dir / name
        tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
        create_private(tmp)
        tmp.write_text(json.dumps({"at": time.time()}))
        replace_durably(tmp, path)
        return path

    def _time_in(self, name: str) -> float | None:
        try:
            return float(json.loads((self.dir / name).read_text())["at"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _touch(self, name: str) -> Path:
        private_dir(self.dir)
        path = self.dir / name
        path.touch()
        return path

    def _each(self, prefix: str) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return [
            p for p in self.dir.iterdir() if p.name == prefix or p.name.startswith(prefix + "-")
        ]


def _file(kind: str, policy: str | None) -> str:
    if policy is None:
        return kind
    if not _NAME.fullmatch(policy):
        raise ConfigError(f"a policy is 1-64 characters of [A-Za-z0-9._-], got {policy!r}")
    return f"{kind}-{policy}"
