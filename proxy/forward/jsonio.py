"""JSON in and out, as every handler of the proxy reads and writes it.

Two encodings, both vLLM 0.32's own: stream chunks are pydantic's JSON (`json_dumps`:
orjson writes the same bytes, floats included), whole answers Python's json through
starlette's JSONResponse (`whole_dumps`: `1e-05` where orjson writes `0.00001`).
"""

from __future__ import annotations

import json

import orjson
from aiohttp import web

from overnight.errors import OvernightError


def json_dumps(obj) -> bytes:
    # vLLM's encoding of stream chunks: compact, UTF-8 as is. orjson is ~5x faster than json.
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError as e:
        # orjson reads 1024 levels but writes 255. Refusing deeper bodies outright keeps
        # the answer the same whatever the interpreter's recursion limit (a library
        # that raises it would otherwise let json.dumps through).
        if "recursion" in str(e).lower():
            raise _too_deep() from None
    try:  # integers over 64 bits: json writes them as vLLM would
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    except RecursionError:
        raise _too_deep() from None


def whole_dumps(obj) -> bytes:
    """A whole answer as vLLM writes it (starlette's JSONResponse.render)."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except RecursionError:
        raise _too_deep() from None


def _too_deep() -> OvernightError:
    return OvernightError("request body is nested too deeply", status=400, code="invalid_json")


async def read_json_object(request: web.Request) -> dict:
    """The request body, which must be a JSON object (else 400 `invalid_json`)."""
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise OvernightError(
            f"request body is not valid JSON: {e}", status=400, code="invalid_json"
        ) from e
    if not isinstance(body, dict):
        raise OvernightError("request body must be a JSON object", status=400, code="invalid_json")
    return body
