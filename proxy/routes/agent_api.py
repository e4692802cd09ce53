"""What agents call: completions (forwarded and recorded), rewards, finishing a rollout.

A completion passes these stages, in this order (`_completion` reads as them):
  read and check (the body size-capped, a JSON object, the fields the proxy reads) ->
  attribute (to a group and rollout) -> authorize (a scoped key's policies and groups,
  a Responses chain's policy; a refusal so far is counted, nothing was forwarded) ->
  choose the route (the alias's adapter, a canary's share, or the hosted model) and open
  the request's Capture -> prepare the upstream body (what recording needs: nothing for
  a hosted API; token ids, logprobs, usage for chat and text; vLLM's ids for Responses;
  Messages as sent) -> hold during maintenance -> forward, teeing the answer to the
  client (what was added hidden again) and into the Capture -> release and count ->
  record after the answer (one record per choice).
What differs by API (its upstream path, what is asked and hidden, its accumulator, its
stream's relay, its request in the chat shape) is its shape's (capture/shapes.py), found
once from the path; Responses and Messages are recorded in the chat shape. The record is
built on the loop's next turn, once the client has its answer, so logging adds no
latency. Rewards and finishes are durable before they are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiohttp import web

from overnight.errors import OvernightError
from overnight.proxy.alias.promotions import Route
from overnight.proxy.capture.additions import lax_bool
from overnight.proxy.capture.attribution import Attribution, attribute, logging_enabled
from overnight.proxy.capture.captures import Capture
from overnight.proxy.capture.conversation import CHAINS
from overnight.proxy.capture.image_urls import IMAGE_FETCHER, IMAGES_FETCHED
from overnight.proxy.capture.recorder import RECORDER
from overnight.proxy.capture.records import (
    RecordFacts,
    finish_row,
    parse_reward,
    record_rows,
    reward_row,
)
from overnight.proxy.capture.redact import REDACTOR
from overnight.proxy.capture.shapes import SHAPES, Added, Shape
from overnight.proxy.forward.jsonio import read_json_object
from overnight.proxy.observe.metrics import METRICS
from overnight.proxy.observe.tracing import TRACING
from overnight.proxy.shadow.sampler import SHADOW
from overnight.proxy.state import MAINTENANCE, POLICIES, STATS, TURNS, WRITER
from overnight.proxy.vllm_sleep import Unavailable
from overnight.storage import now_us
from overnight.storage.read.sent_by import CLIENT

from .auth import SENT_BY
from .handover import HostedBeside, hop_of, hosted_of
from .hosted import HostedUpstream, request_bytes
from .keys import check_chain, check_completion, check_rollout, record_note, remember
from .relay import CLIENT_LEFT_EARLY, forward, passthrough

log = logging.getLogger("overnight.proxy")

# Each API family's shape (capture/shapes.py) by the path it is called at, under /v1/.
ENDPOINTS = {shape.path.removeprefix("/v1/"): shape for shape in SHAPES.values()}
NO_HOLD = contextlib.nullcontext()  # stateless: one for every request that needs none


# The fields the proxy itself needs, and the JSON type it reads each as (null is fine).
# Anything else is the upstream's to judge; a wrong type here would fail in the proxy.
# (`stream` and `stream_options` are read as vLLM reads them, and where vLLM would
# refuse them nothing is added: additions.unreadable.)
FIELD_TYPES: dict[str, type] = {"model": str}
JSON_NAMES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}


class InternalError(OvernightError):
    """What the client is told of a failure of the proxy's own; the log has the traceback."""

    status = 500
    code = "internal_error"

    def __init__(self, request_id: str):
        super().__init__(f"the proxy failed on this request (request id {request_id})")
        self.request_id = request_id


async def completions(request: web.Request) -> web.StreamResponse:
    """A served completion, forwarded and recorded. It counts as in flight for shadow
    sampling from the moment it is accepted, before its body is read: a sibling request
    must not start (and one running is cancelled) while a served request is on its way
    to the upstream, not only once it was forwarded."""
    shadow = request.app[SHADOW]
    shadow.accept()
    try:
        return await _completion(request)
    finally:
        shadow.release()


async def _completion(request: web.Request) -> web.StreamResponse:
    """A completion through its stages, in the order it passes them (each a function
    below, in the same order). The awaits stay here, so a stage adds no await: only
    Responses, Messages and hosted requests wait for more than the body and the answer."""
    app, shape, started = request.app, shape_of(request), now_us()
    try:  # read and check, attribute, authorize: a refusal, nothing forwarded, is counted
        body = await read_json_object(request)  # size-capped
        check_fields(body)
        who = attribute_to_rollout(request, body)
        authorize(request, body, who)
        if shape.continues(body):  # nor another policy's Responses chain
            await check_chain(request, body, app[CHAINS])
    except OvernightError as e:
        count_refusal(app, shape.endpoint, e, request.get(SENT_BY, CLIENT))
        raise
    route = choose_route(app, body, who)  # in flight on it until `release_and_count`
    capture = open_capture(request, shape.endpoint, body, who, route, started)
    hosted = hosted_of(app, route)  # a hosted API serves it (hosted.py); None: vLLM
    try:
        if hosted is None and IMAGE_FETCHER in app and logging_enabled(request.headers):
            # The listed hosts' image URLs, sent as data (capture/image_urls.py).
            body, request[IMAGES_FETCHED] = await app[IMAGE_FETCHER].inline(body)
            capture.request_body = body  # what vLLM is sent is what the record holds
        upstream_body, added = prepare_upstream_body(request, body, capture, hosted)
        # A hosted API is sent the client's own bytes where the body is still theirs.
        raw = None if hosted is None else request_bytes(await request.read(), upstream_body)
        # Responses, Messages: recorded in the chat shape (a Responses chain looked up).
        capture.request_body = await shape.recorded_request(app, body)
        affinity = who.rollout_id or who.group_id  # every turn of a rollout on one replica
        hop = hop_of(app, route)  # the hosted API beside vLLM (handover.py), or None
        async with hold_during_maintenance(app, hop):
            return await forward(request, upstream_body, added, capture, affinity, raw, hop)
    except Unavailable as e:  # the hold ran out: the client is told when to retry
        capture.fail(e.status, f"maintenance: {e}")
        raise
    except (OvernightError, web.HTTPException):
        raise
    except asyncio.CancelledError:  # aiohttp cancels a handler whose client left
        if capture.error is None:
            capture.fail(None, CLIENT_LEFT_EARLY)
        raise
    except Exception as e:
        raise internal_error(capture, e) from e
    finally:
        release_and_count(app, capture)
        record_after_the_answer(request, capture, who, started)


# -- the stages, in the order a completion passes them ---------------------------------


def shape_of(request: web.Request) -> Shape:
    """Which API was called: chat or text completions, Responses, Messages."""
    return ENDPOINTS[request.match_info.get("tail", request.path.removeprefix("/v1/"))]


def check_fields(body: dict) -> None:
    for name, kind in FIELD_TYPES.items():
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            got = JSON_NAMES.get(type(value), "a number")
            raise OvernightError(
                f"'{name}' must be {JSON_NAMES[kind]}, got {got}", status=400, code="invalid_type"
            )


def attribute_to_rollout(request: web.Request, body: dict) -> Attribution:
    """The request's group and rollout: headers, then a URL prefix, then body `metadata`."""
    info = request.match_info
    return attribute(request.headers, info.get("group"), info.get("rollout"), body)


def authorize(request: web.Request, body: dict, who: Attribution) -> None:
    """A scoped key asks only for its models, in its groups (keys.py); the Responses
    chain it continues is checked next, in the hub (that check awaits the store)."""
    check_completion(request, body.get("model"), who)


def count_refusal(
    app: web.Application, endpoint: str, error: OvernightError, sent_by: str = CLIENT
) -> None:
    """A completion refused before anything was forwarded (after it, _record counts it)."""
    metrics = app.get(METRICS)  # absent with --no-metrics
    if metrics is not None:
        metrics.refused(endpoint, error, sent_by)


def choose_route(app: web.Application, body: dict, who: Attribution) -> Route:
    """The upstream model and adapter: the requested alias's policy, or a pass-through. A
    canary takes a sticky share of the alias, keyed by the rollout (or its group); so
    does a handover's hosted model (handover.py). The request counts in flight on it."""
    return app[POLICIES].route(body.get("model"), who.rollout_id or who.group_id)


def open_capture(
    request: web.Request,
    endpoint: str,
    body: dict,
    who: Attribution,
    route: Route,
    started: int,
) -> Capture:
    """What the answer will fill in; its id remembered for a scoped key's rewards, its
    span started when tracing is on."""
    app = request.app
    stream = lax_bool(body.get("stream")) is True  # as vLLM reads it
    capture = Capture(endpoint, stream, request_body=body, route=route)
    capture.sent_by = request.get(SENT_BY, CLIENT)  # the operator's own, or a client's
    if RECORDER in app:  # what the accumulator is given, kept for the recorder process
        capture.answer = []
    remember(request, who, capture.request_id, body.get("model"))  # for scoped rewards
    tracing = app.get(TRACING)  # absent unless tracing is on: then no span at all
    if tracing is not None:
        tracing.start(request, capture, who, started)
    return capture


def prepare_upstream_body(
    request: web.Request,
    body: dict,
    capture: Capture,
    hosted: HostedUpstream | None,
) -> tuple[dict, Added]:
    """What goes upstream (the alias named as the model served) with what recording
    needs added, and what was added (hidden again from the answer); the Capture's
    accumulator made to match. Nothing for a hosted API; else its shape's."""
    route = capture.route
    upstream_body = dict(body, model=route.served)
    if hosted is not None:
        # A hosted API (the app's own, or the one beside vLLM that serves the rollouts
        # outside a handover's share): nothing added; a hosted model named by the client
        # goes as it came. Its record says why it has no token ids.
        if route.policy is None:
            upstream_body = body
        capture.use(note=hosted.note)
        return upstream_body, capture.shape.nothing_added()
    # Chat and text: vLLM's token ids, logprobs and usage (additions.py); Responses: its
    # token ids and logprobs (apis.py); Messages: nothing to ask for, relayed verbatim.
    return upstream_body, capture.shape.ask_for_ids(request, body, upstream_body, capture)


def hold_during_maintenance(
    app: web.Application, hop: HostedBeside | None
) -> contextlib.AbstractAsyncContextManager:
    """Held while vLLM sleeps for a colocated night (vllm_sleep.py), refused
    503 when the hold runs out; the hosted model beside it (`hop`) serves on."""
    return app[MAINTENANCE].serving() if hop is None else NO_HOLD


def internal_error(capture: Capture, e: Exception) -> InternalError:
    """A bug of the proxy's: the record says so, the log has the traceback, the client
    gets a 500 JSON error naming the request (auth.make_guard would catch it too, but
    without a record)."""
    log.exception("completion %s failed", capture.request_id)
    status = capture.status if capture.status >= 400 else 500
    capture.fail(status, f"internal error: {e!r}"[:4096])
    return InternalError(capture.request_id)


def release_and_count(app: web.Application, capture: Capture) -> None:
    """However the request ended: its adapter released (and noticed missing on a 404),
    the request counted, a Responses reply remembered for the chain it may continue."""
    route, adapters = capture.route, app[POLICIES]
    adapters.release(route)
    if capture.status == 404 and not route.hosted:  # vLLM restarted, lost the adapter?
        adapters.notice_missing(route.served)
    app[STATS].requests += 1
    capture.shape.answered(app, capture)  # a Responses reply: the chain it may continue


def record_after_the_answer(
    request: web.Request, capture: Capture, who: Attribution, started: int
) -> None:
    """The last stage: the record is scheduled, not built here. It is built on the loop's
    next turn, once the response is on its way (aiohttp writes it before this task next
    yields), so the client never waits for its record, and a burst of answers is not
    held up by the records of the earlier ones (_record, below)."""
    logged = logging_enabled(request.headers)
    note = record_note(request)  # a scoped key's name and refusals, for its record
    if request.get(IMAGES_FETCHED):  # image URLs the proxy fetched, or why not
        note = {**(note or {}), "images_fetched": request[IMAGES_FETCHED]}
    asyncio.get_running_loop().call_soon(_record, request.app, capture, who, started, logged, note)


def _record(
    app: web.Application,
    capture: Capture,
    who: Attribution,
    started: int,
    logged: bool,
    key_note: dict | None = None,
) -> None:
    metrics = app.get(METRICS)  # absent with --no-metrics
    if metrics is not None:  # first: its clock stops when the answer was written
        metrics.observe(capture, started)
    hosted = hosted_of(app, capture.route)
    hosted_label = hosted.label if hosted else None
    facts = RecordFacts(started, now_us(), logged, key_note, hosted_label, capture.sent_by)
    recorder = app.get(RECORDER)
    if recorder is not None:  # built and written by the recorder process (recorder.py)
        recorder.record(capture, who, facts)
        return
    writer = app[WRITER]
    try:
        rows = record_rows(capture, who, app[TURNS], writer.writer_id, facts)
    except Exception:  # a response of a shape the capture did not foresee: say so loudly
        log.exception("could not build the record of request %s", capture.request_id)
        if capture.span is not None:
            app[TRACING].end(capture, [])
        return
    for row in app[REDACTOR].apply(rows):  # the user's --redact hook (redact.py)
        writer.append("completions", row)
    if capture.span is not None:  # after the hook: a trace shows what the store keeps
        app[TRACING].end(capture, rows)
    app[SHADOW].offer(rows)  # siblings of the turn, asked for now that its answer was sent


async def prefixed(request: web.Request) -> web.StreamResponse:
    """/rollouts/{group}/{rollout}/v1/... for clients that can only set a base URL."""
    if request.match_info["tail"] in ENDPOINTS and request.method == "POST":
        return await completions(request)
    return await passthrough(request)


async def post_reward(request: web.Request) -> web.Response:
    rollout_id = request.match_info["rollout_id"]
    await check_rollout(request, rollout_id)  # a scoped key: its policies' rollouts only
    reward, metrics = parse_reward(await read_json_object(request))
    writer = request.app[WRITER]
    row = reward_row(rollout_id, reward, metrics, writer.writer_id)
    await writer.wait_committed(writer.append("rewards", row))
    return web.json_response({"rollout_id": rollout_id, "reward": reward, "recorded": True})


async def post_finish(request: web.Request) -> web.Response:
    rollout_id = request.match_info["rollout_id"]
    await check_rollout(request, rollout_id)
    if request.body_exists:
        await read_json_object(request)  # must be JSON if present; nothing in it is used
    writer = request.app[WRITER]
    row = finish_row(rollout_id, writer.writer_id)
    await writer.wait_committed(writer.append("finishes", row))
    return web.json_response({"rollout_id": rollout_id, "finished": True})
