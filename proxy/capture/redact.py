"""The redaction hook: the user's function sees each record before it is written.

`overnight serve --redact module:function` (or `path/to/file.py:function`) names a
function that takes the parts of a completion record that hold what was said,

    {"request": dict | None, "response": dict | None, "prompt_token_ids": list | None,
     "completion_token_ids": list | None, "completion_logprobs": list | None}

and returns a dict of the ones to store instead (keys it leaves out are stored as
they were). It runs on the proxy's event loop, once per choice, after the client has
its answer: keep it fast, and return new values rather than changing the ones it got
(the `n` choices of one request share the request). Token ids and logprobs spell the
text they were sampled as: a function that masks text should drop them too (the
trainer then re-tokenises the masked text; see examples/redact_emails.py).

A function that raises stores none of the five (the row keeps its ids, timing and
status, with `logged` false and the failure in `error`), counts the failure in
`/admin/stats` and logs it: the record is never stored unredacted, and never lost
without a trace.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from overnight.errors import ConfigError

log = logging.getLogger("overnight.proxy")

FIELDS = (
    "request",
    "response",
    "prompt_token_ids",
    "completion_token_ids",
    "completion_logprobs",
)


class Redactor:
    """Applies the hook to rows; without one (`spec` None) rows pass unchanged."""

    def __init__(self, spec: str | None):
        self.spec = spec
        self.fn: Callable[[dict], dict] | None = load_function(spec) if spec else None
        self.failures = 0

    def apply(self, rows: list[dict]) -> list[dict]:
        if self.fn is not None:
            for row in rows:
                if row.get("logged", True):
                    self._redact(row)
        return rows

    def _redact(self, row: dict) -> None:
        try:
            out = self.fn({name: row.get(name) for name in FIELDS})
            if not isinstance(out, dict):
                raise TypeError(f"returned {type(out).__name__}, expected a dict")
            for name in FIELDS:
                if name in out:
                    row[name] = out[name]
        except Exception as e:  # the user's code: the row must still be stored, bodiless
            self.failures += 1
            for name in FIELDS:
                row[name] = None
            row["logged"] = False
            note = f"redaction failed ({type(e).__name__}): bodies not stored"
            row["error"] = f"{row['error']}; {note}" if row.get("error") else note
            if self.failures <= 10 or self.failures % 1000 == 0:  # loud, not a flood
                log.exception("redaction hook %s failed (%d so far)", self.spec, self.failures)


REDACTOR = web.AppKey("redactor", Redactor)


def load_function(spec: str) -> Callable[[dict], dict]:
    """`module:function` or `path/to/file.py:function`, as `--reward` takes them."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--redact {spec!r}: expected module:function or file.py:function")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser().resolve()
            name = f"overnight_redact_{path.stem}"
            loader = importlib.util.spec_from_file_location(name, path)
            if loader is None or loader.loader is None:
                raise ImportError(f"cannot load {path}")
            module = importlib.util.module_from_spec(loader)
            sys.path.insert(0, str(path.parent))  # its own imports beside it
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, OSError) as e:
        raise ConfigError(f"--redact {spec!r}: {e}") from e
    if not callable(fn):
        raise ConfigError(f"--redact {spec!r}: {attr} is not a function")
    return fn
