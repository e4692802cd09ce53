"""The record schema: one Arrow schema per table, and the version that names it.

Every row carries `schema_version`; readers refuse versions newer than
`SCHEMA_VERSION` with a message that says what to do, instead of misreading them.
Bump the version when a column changes meaning; adding a nullable column does not
need a bump (DuckDB unions segments by name). Version 2: a request with n > 1 choices
is stored once, on its first choice's row (`request_shared`); a version 1 reader would
read the other choices' requests as null, so it must refuse these rows.

`fit_row` checks a row against its table before it reaches the log: a value that does
not fit its column (a number as `model_requested`, a string as `turn_index`) would make
Arrow refuse the whole log file at compaction, so it is stored in a form that fits,
its JSON text in a string column, null elsewhere, with a note in the row's `notes`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Iterator

import orjson
import pyarrow as pa

SCHEMA_VERSION = 2

_TS = pa.timestamp("us", tz="UTC")
# In every table, last: JSON object text, column name -> what was changed to make the
# row fit (see `fit_row`); null for a row stored as it came. Nullable and added without
# a version bump: segments written before it read as null (DuckDB unions by name).
NOTES = pa.field("notes", pa.string())

# One row per choice of a chat or text completion that passed through the proxy.
COMPLETIONS = pa.schema(
    [
        ("record_id", pa.string()),  # unique per row
        ("request_id", pa.string()),  # shared by the n choices of one HTTP request
        ("schema_version", pa.int16()),
        ("started_at", _TS),
        ("ended_at", _TS),
        ("group_id", pa.string()),
        ("rollout_id", pa.string()),
        ("attribution", pa.string()),  # header | url | metadata | choices | none
        (
            "turn_index",
            pa.int32(),
        ),  # model turns before it in its conversation (proxy/capture/records.py)
        ("choice_index", pa.int32()),
        ("endpoint", pa.string()),  # chat.completions | completions
        ("model_requested", pa.string()),
        ("model_served", pa.string()),  # the name vLLM served: base model or lora name
        ("adapter_version", pa.int32()),  # null when the base model served
        ("request", pa.string()),  # JSON, as the client sent it (metadata removed)
        # True on every row of a logged request with n > 1 choices: only the first of
        # them stores `request`, the others read it from there (the `completions` view
        # fills it in), so a request is stored once, not once per choice. Null otherwise.
        ("request_shared", pa.bool_()),
        ("response", pa.string()),  # JSON, this choice as a non-streamed response
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
        ("completion_logprobs", pa.list_(pa.float32())),
        ("finish_reason", pa.string()),
        ("http_status", pa.int16()),
        ("error", pa.string()),  # null on success; why the completion is partial
        ("partial", pa.bool_()),  # the stream ended before a finish_reason
        ("latency_ms", pa.float64()),
        ("ttft_ms", pa.float64()),  # time to the first upstream byte
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("stream", pa.bool_()),
        ("logged", pa.bool_()),  # false under X-Rollout-Log: off (bodies not kept)
        ("proxy_id", pa.string()),  # the proxy process that wrote the row
        # Who sent the request: `client` (an agent), or what of overnight's own sent it
        # through the proxy (storage/read/sent_by.py: eval, judge, ...). Nullable, added
        # without a version bump: rows written before it read as `client` (reader.py).
        ("sent_by", pa.string()),
        NOTES,
    ]
)

# Rewards an agent posted (source 'agent'); the judge adds its own sources later.
REWARDS = pa.schema(
    [
        ("reward_id", pa.string()),
        ("schema_version", pa.int16()),
        ("rollout_id", pa.string()),
        ("reward", pa.float64()),
        ("metrics", pa.string()),  # JSON object
        ("source", pa.string()),  # agent | ruler | function | combined
        ("created_at", _TS),
        ("proxy_id", pa.string()),  # the process that wrote it (a proxy or a judge run)
        ("judgment_id", pa.string()),  # for rewards derived from a judgment
        NOTES,
    ]
)

# One row per group judged (or failed) by an LLM judge; re-judging adds rows.
JUDGMENTS = pa.schema(
    [
        ("judgment_id", pa.string()),
        ("schema_version", pa.int16()),
        ("group_id", pa.string()),
        ("judge_model", pa.string()),
        ("rubric_hash", pa.string()),
        ("prompt_hash", pa.string()),  # of exactly what was sent: the cache key
        ("created_at", _TS),
        (
            "scores",
            pa.list_(
                pa.struct(
                    [
                        ("rollout_id", pa.string()),
                        ("score", pa.float64()),
                        ("explanation", pa.string()),
                    ]
                )
            ),
        ),
        ("error", pa.string()),  # null when the group was scored
        ("attempts", pa.int32()),  # calls made, retries and corrections included
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("cost_usd", pa.float64()),  # null when the judge has no known price
        ("latency_ms", pa.float64()),
        ("proxy_id", pa.string()),
        NOTES,
    ]
)

# A rollout is finished by an explicit POST .../finish; idle rollouts finish by time.
FINISHES = pa.schema(
    [
        ("rollout_id", pa.string()),
        ("schema_version", pa.int16()),
        ("finished_at", _TS),
        ("proxy_id", pa.string()),
        NOTES,
    ]
)

# One row per `overnight train` run: what it trained on, what it made, how it went.
TRAINING_RUNS = pa.schema(
    [
        ("run_id", pa.string()),
        ("schema_version", pa.int16()),
        ("started_at", _TS),
        ("ended_at", _TS),
        ("status", pa.string()),  # trained | failed
        ("base_model", pa.string()),
        ("start_adapter", pa.string()),  # the adapter training started from; null: fresh
        ("adapter_path", pa.string()),  # where the new adapter was saved
        ("promoted_as", pa.string()),  # the name vLLM serves it under; null if not promoted
        ("groups", pa.list_(pa.string())),
        ("rollouts", pa.int32()),
        ("trained_tokens", pa.int64()),
        ("steps", pa.int32()),
        ("reward_mean", pa.float64()),
        ("max_logprob_gap", pa.float64()),  # |policy - logged| before the first update
        ("config", pa.string()),  # JSON
        ("metrics", pa.string()),  # JSON: per step and per group statistics
        ("error", pa.string()),
        ("proxy_id", pa.string()),
        NOTES,
    ]
)

# Alternatives sampled for a served turn (issue 15): the served choice and its siblings
# form a per-turn group (storage/read/siblings.py). A table of its own, so that no reader of
# served traffic (the `completions` view and everything built on it) ever sees them. The
# prompt and the request are not copied: they are the served row's (`sibling_of`).
SIBLINGS = pa.schema(
    [
        ("record_id", pa.string()),
        ("schema_version", pa.int16()),
        ("started_at", _TS),  # the sampling call, shared by its n rows
        ("ended_at", _TS),
        ("sibling_of", pa.string()),  # record_id of the served row in `completions`
        ("group_id", pa.string()),  # the per-turn group: "turn:" + sibling_of
        ("rollout_id", pa.string()),  # this alternative: group_id + ":" + record_id
        ("origin", pa.string()),  # resample (the nightly stage) | shadow (the proxy)
        ("choice_index", pa.int32()),  # in the sampling call; null on an error row
        ("model_served", pa.string()),
        ("request", pa.string()),  # JSON: the /v1/completions body sent, without its prompt
        ("response", pa.string()),  # JSON: this alternative in the served endpoint's shape
        ("completion_token_ids", pa.list_(pa.int32())),
        ("completion_logprobs", pa.list_(pa.float32())),
        ("finish_reason", pa.string()),
        ("error", pa.string()),  # null on success; an error row records a failed call
        ("latency_ms", pa.float64()),
        ("completion_tokens", pa.int32()),
        ("proxy_id", pa.string()),
        NOTES,
    ]
)

# The Responses API's ids, written by compaction beside their records (response_index.py):
# what a `previous_response_id` lookup reads instead of every record's response text.
RESPONSE_IDS = pa.schema(
    [("response_id", pa.string()), ("record_id", pa.string()),
     ("schema_version", pa.int16()), ("started_at", _TS)]  # the record's
)  # fmt: skip

# What the next exchange of a conversation says about a logged turn (judge/signals.py):
# one row per signal, read from the traffic alone; `overnight signals` writes them. The
# same signal found again has the same `signal_id` and is not written twice.
SIGNALS = pa.schema(
    [
        ("signal_id", pa.string()),
        ("schema_version", pa.int16()),
        ("created_at", _TS),
        ("record_id", pa.string()),  # the turn it is about (`completions`)
        ("rollout_id", pa.string()),
        ("group_id", pa.string()),
        ("kind", pa.string()),  # accepted | corrected | re_asked | moved_on | regenerated | ...
        ("value", pa.float64()),  # -1 (bad) .. +1 (good); 0 says nothing either way
        ("confidence", pa.float64()),  # 0 .. 1
        ("rule", pa.string()),  # which rule (or classifier) said so
        ("source", pa.string()),  # rules
        ("evidence", pa.string()),  # the text it read, cut
        ("evidence_record", pa.string()),  # the record whose request carried it
        ("extra", pa.string()),  # JSON object: a rule's numbers (a re-ask's similarity)
        ("proxy_id", pa.string()),  # the process that wrote it
        NOTES,
    ]
)

TABLES: dict[str, pa.Schema] = {
    "completions": COMPLETIONS,
    "rewards": REWARDS,
    "finishes": FINISHES,
    "judgments": JUDGMENTS,
    "training_runs": TRAINING_RUNS,
    "siblings": SIBLINGS,
    "response_ids": RESPONSE_IDS,
    "signals": SIGNALS,
}

# Columns written as JSON text that hold timestamps as ISO strings in the log.
TIMESTAMP_COLUMNS = {
    name: [f.name for f in schema if pa.types.is_timestamp(f.type)]
    for name, schema in TABLES.items()
}


def schema_fingerprint(schema: pa.Schema) -> str:
    """A short name for a schema's columns (names and types, in order). A merged file
    whose manifest entry carries the reader's own fingerprint is read with the others
    like it, without a look at its footer or unioning columns by name (reader.py)."""
    text = ";".join(f"{f.name}:{f.type}" for f in schema)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class SchemaVersionError(Exception):
    """Data written by a newer overnight than this one."""


def check_versions(table: str, versions: list[int]) -> None:
    newer = sorted({v for v in versions if v is not None and v > SCHEMA_VERSION})
    if newer:
        raise SchemaVersionError(
            f"{table}: rows with schema version {newer} are newer than this overnight "
            f"understands (version {SCHEMA_VERSION}); upgrade overnight to read them"
        )


# -- making a row fit its table ------------------------------------------------------------

# Columns that hold JSON text: logged as nested JSON, encoded once, at compaction.
JSON_COLUMNS = frozenset({"request", "response", "metrics", "config", "notes"})
# What Arrow raises when a Python value does not fit a column.
ARROW_ERRORS = (pa.ArrowException, TypeError, ValueError, OverflowError)
# The longest original value quoted in a note (its JSON text), so that a note stays small.
NOTE_VALUE_CHARS = 2000
_UNREADABLE = object()


def _spec(t: pa.DataType) -> tuple[frozenset[type], int | None, int | None]:
    """(Python types that surely fit `t`, and the range an int must be in)."""
    if pa.types.is_string(t):
        return frozenset({str}), None, None
    if pa.types.is_boolean(t):
        return frozenset({bool}), None, None
    if pa.types.is_integer(t) or pa.types.is_timestamp(t):
        bits = 64 if pa.types.is_timestamp(t) else t.bit_width
        return frozenset({int}), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    if pa.types.is_floating(t):  # Arrow refuses ints a double cannot hold exactly
        return frozenset({float, int}), -(2**53), 2**53
    # Lists: their items are checked where Arrow converts them (at compaction), so that
    # the hot path stays a type lookup per column, not one per token id.
    return frozenset({list, tuple}), None, None


_SPECS = {
    table: {f.name: _spec(f.type) for f in schema if f.name not in JSON_COLUMNS}
    for table, schema in TABLES.items()
}


def fit_row(table: str, row: dict) -> dict:
    """`row` itself when each of its values fits its column, else a copy that fits.

    This runs per row on the proxy's hot path (in the writer thread): one dict lookup and
    one type test per column. JSON columns take any value; columns the table does not
    know are left alone (compaction drops them). Raises KeyError for an unknown table
    and TypeError for a row that is not a dict.
    """
    specs = _SPECS[table]
    if type(row) is not dict:
        raise TypeError(f"a {table} row must be a dict, not {type(row).__name__}")
    for name, value in row.items():
        spec = specs.get(name)
        if spec is None or value is None:
            continue
        kind = type(value)
        if kind not in spec[0] or (
            spec[1] is not None and kind is int and not spec[1] <= value <= spec[2]
        ):
            return _refit(table, row)
    return row


def _refit(table: str, row: dict) -> dict:
    fitted = dict(row)  # never change the caller's dict
    schema = TABLES[table]
    for name, spec in _SPECS[table].items():
        value = row.get(name)
        if value is None:
            continue
        kind = type(value)
        if kind in spec[0] and (spec[1] is None or kind is not int or spec[1] <= value <= spec[2]):
            continue
        fitted[name], note = fit_value(schema.field(name).type, value)
        if note:
            add_note(fitted, name, note)
    return fitted


def fits(t: pa.DataType, value: object) -> bool:
    """Whether `value` goes into a column of type `t` as it is. Stricter than Arrow,
    which cuts 1.5 to 1 in an int column and takes "ab" as the list ["a", "b"]."""
    if value is None:
        return True
    kind = type(value)
    if pa.types.is_string(t):
        return kind is str
    if pa.types.is_boolean(t):
        return kind is bool
    if pa.types.is_integer(t) or pa.types.is_timestamp(t):
        if kind is float and value.is_integer():  # type: ignore[attr-defined]
            value, kind = int(value), int  # JSON has no ints: 3.0 is 3
        _, lo, hi = _spec(t)
        return kind is int and lo <= value <= hi  # type: ignore[operator]
    if pa.types.is_floating(t):
        return kind is float or (kind is int and abs(value) <= 2**53)  # type: ignore[arg-type]
    if pa.types.is_list(t):
        return kind in (list, tuple) and all(fits(t.value_type, v) for v in value)  # type: ignore[attr-defined]
    if pa.types.is_struct(t):
        return kind is dict and all(fits(f.type, value.get(f.name)) for f in t)  # type: ignore[attr-defined]
    try:  # nothing else is in the schema today
        pa.array([value], type=t)
        return True
    except ARROW_ERRORS:
        return False


def fit_value(t: pa.DataType, value: object) -> tuple[object, str | None]:
    """A value that fits `t`, and a note saying what was changed (None: nothing lost)."""
    text = json_text(value)
    try:  # what the log gives back: a datetime, a UUID, a numpy number, as JSON has them
        back = orjson.loads(text)
    except ValueError:  # deeper than orjson reads
        back = _UNREADABLE
    if back is not _UNREADABLE and (back is None) == (value is None) and fits(t, back):
        return back, None
    what = f"{type(value).__name__} does not fit {t}"
    if pa.types.is_string(t):
        return text, f"{what}: stored as its JSON text"
    if len(text) > NOTE_VALUE_CHARS:
        text = f"{text[:NOTE_VALUE_CHARS]}... ({len(text)} characters)"
    return None, f"{what}: stored as null; the value was {text}"


def add_note(row: dict, column: str, note: str) -> None:
    notes = row.get("notes")
    if isinstance(notes, str):  # already encoded (at compaction)
        with contextlib.suppress(ValueError):
            notes = orjson.loads(notes)
    if not isinstance(notes, dict):
        notes = {} if notes is None else {"notes": notes}
    row["notes"] = {**notes, column: note}


# -- JSON text that never fails ------------------------------------------------------------


def json_text(value: object) -> str:
    """`value` as JSON text, whatever it holds: nesting deeper than any recursion limit,
    ints over 64 bits, keys that are not strings, a container holding itself (cut off
    as "<cycle>"), objects JSON has no type for (their str())."""
    try:
        return orjson.dumps(value, default=_str, option=orjson.OPT_NON_STR_KEYS).decode()
    except (TypeError, ValueError):  # orjson stops at 255 levels and at 64-bit ints
        return "".join(_iter_json(value))


def _str(value: object) -> str:
    try:
        return str(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"


def _iter_json(value: object) -> Iterator[str]:
    # An explicit stack instead of recursion: no depth limit. Each entry is either text
    # to emit, a value to encode, or the id of a container whose encoding ends there.
    stack: list[tuple[str, object]] = [("value", value)]
    inside: set[int] = set()
    while stack:
        what, item = stack.pop()
        if what == "text":
            yield item  # type: ignore[misc]
        elif what == "leave":
            inside.discard(item)  # type: ignore[arg-type]
        elif isinstance(item, dict | list | tuple):
            if id(item) in inside:
                yield '"<cycle>"'
                continue
            inside.add(id(item))
            stack.append(("leave", id(item)))
            stack.extend(reversed(list(_members(item))))
        else:
            yield _scalar(item)


def _members(item: dict | list | tuple) -> Iterator[tuple[str, object]]:
    """The stack entries of one container, in output order."""
    is_dict = isinstance(item, dict)
    yield "text", "{" if is_dict else "["
    pairs = item.items() if is_dict else enumerate(item)
    for i, (key, member) in enumerate(pairs):
        comma = "," if i else ""
        yield (
            "text",
            comma + (_scalar(key if isinstance(key, str) else _str(key)) + ":" if is_dict else ""),
        )
        yield "value", member
    yield "text", "}" if is_dict else "]"


def _scalar(value: object) -> str:
    if value is None or value is True or value is False:
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return repr(float(value)) if math.isfinite(value) else "null"
    if isinstance(value, str):
        try:
            return orjson.dumps(value).decode()
        except TypeError:  # a lone surrogate: escaped as \\udXXX, which JSON allows
            return json.dumps(value)
    return _scalar(_str(value))
