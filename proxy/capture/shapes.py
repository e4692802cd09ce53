"""One shape per API family the proxy forwards and records: what differs between them.

vLLM keeps one serving class per API; the proxy keeps one shape per family, each owning
its upstream path, what it asks of vLLM for the record (and hides again), its
accumulator, its stream's event relay and its request in the chat shape the record
keeps:

  Completions  chat and text completions: vLLM's own shape, recorded as it comes; token
               ids, logprobs and usage asked for (additions.py, chat.py)
  Responses    `/v1/responses`: vLLM's token ids asked for and hidden again (apis.py), the
               request recorded in the chat shape, its chain remembered (conversation.py)
  Messages     `/v1/messages`: nothing to ask for, relayed verbatim, recorded in the
               chat shape

A request's shape is found once, from its endpoint (`SHAPES`; a `Capture` holds it), and
the route and the relay ask it, never the endpoint, what to do.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from overnight.proxy.forward.jsonio import whole_dumps

from .additions import Additions, add_training_fields, hidden_answer, unreadable
from .apis import (
    MessagesAccumulator,
    ResponsesAccumulator,
    ResponsesAdditions,
    add_responses_fields,
    hide_responses_additions,
    refused_additions,
)
from .attribution import logging_enabled
from .chat import CHAT, TEXT, Accumulator
from .conversation import (
    CHAINS,
    MESSAGES,
    RESPONSES,
    messages_request,
    resolve_responses_request,
)
from .events import EventRelay, ResponsesEventRelay, SeenFingerprint, Take

Added = Additions | ResponsesAdditions  # what the proxy asked for, to hide again


class Shape:
    """What every family does alike; each below changes what is its own."""

    endpoint = ""  # the record's `endpoint`
    path = ""  # where vLLM serves it
    stream_end = "its last event"  # what a whole stream ends with
    operation = "chat"  # its GenAI operation, as a span names it (observe/tracing.py)

    def accumulator(
        self,
        echo: bool = False,
        as_ids: bool = False,
        hidden: ResponsesAdditions | None = None,
        note: str | None = None,
    ) -> Any:
        """The answer's accumulator (`Capture.use`, from a recipe a recorder process can
        make it again from); `note`: why its record will have no token ids."""
        raise NotImplementedError

    def nothing_added(self) -> Added:
        """What was added where nothing was: a hosted upstream, a request sent plain."""
        return Additions()

    def ask_for_ids(self, request: web.Request, body: dict, upstream: dict, capture: Any) -> Added:
        """Add to `upstream` (what goes to vLLM; `body` is the client's) what recording
        needs, and make `capture`'s accumulator match (the one it began with fits where
        nothing was asked); what was added, to hide again."""
        return self.nothing_added()

    def hidden(self, obj: dict, raw: bytes, added: Added) -> bytes:
        """A whole answer (`raw`, parsed: `obj`) as the client gets it: without `added`."""
        return raw

    def relay(self, added: Added, take: Take, fingerprint: SeenFingerprint) -> EventRelay:
        """A stream's events as the client gets them, each given to `take`."""
        return EventRelay(added, take, fingerprint)  # type: ignore[arg-type]

    async def recorded_request(self, app: web.Application, body: dict) -> dict:
        """The request as its record keeps it: in the chat shape."""
        return body

    def continues(self, body: dict) -> Any:
        """The earlier answer a request continues (a scoped key must own it), if any."""
        return None

    def additions_refused(self, app: web.Application, body: dict) -> None:
        """vLLM refused what was added, and answered the plain request."""

    def answered(self, app: web.Application, capture: Any) -> None:
        """After the answer, whatever its outcome: what a later request may need of it."""


class Completions(Shape):
    """Chat and text completions: vLLM's token ids, logprobs and usage asked for where
    asking leaves its answer as it would be (additions.py); a stream ends with [DONE]."""

    stream_end = "[DONE]"

    def __init__(self, endpoint: str, path: str, operation: str):
        self.endpoint = endpoint
        self.path = path
        self.operation = operation

    def accumulator(
        self,
        echo: bool = False,
        as_ids: bool = False,
        hidden: ResponsesAdditions | None = None,
        note: str | None = None,
    ) -> Accumulator:
        acc = Accumulator(self.endpoint, echo=echo, as_ids=as_ids)
        acc.note = note
        return acc

    def ask_for_ids(
        self, request: web.Request, body: dict, upstream: dict, capture: Any
    ) -> Additions:
        added = add_training_fields(upstream, self.endpoint)
        if added.echo or added.note:  # the prompt's logprobs come first; or no ids
            capture.use(echo=added.echo, as_ids=added.as_ids, note=added.note)
        return added

    def hidden(self, obj: dict, raw: bytes, added: Added) -> bytes:
        return hidden_answer(raw, obj, added)  # type: ignore[arg-type]


class Responses(Shape):
    """`/v1/responses`: vLLM's token ids and logprobs asked for (not of a model whose
    vLLM refused them) and hidden again (apis.py); the request recorded in the chat
    shape, a `previous_response_id` chain resolved (conversation.py) and remembered."""

    endpoint = RESPONSES
    path = "/v1/responses"

    def accumulator(
        self,
        echo: bool = False,
        as_ids: bool = False,
        hidden: ResponsesAdditions | None = None,
        note: str | None = None,
    ) -> ResponsesAccumulator:
        acc = ResponsesAccumulator(hidden)
        acc.note = note
        return acc

    def nothing_added(self) -> ResponsesAdditions:
        return ResponsesAdditions()

    def ask_for_ids(
        self, request: web.Request, body: dict, upstream: dict, capture: Any
    ) -> ResponsesAdditions:
        if (
            not logging_enabled(request.headers)
            or capture.route.served in refused_additions(request.app)
            or unreadable(body)
        ):
            return ResponsesAdditions()  # nothing asked: none to hide
        added = add_responses_fields(upstream)
        capture.use(hidden=added)
        return added

    def hidden(self, obj: dict, raw: bytes, added: Added) -> bytes:
        hidden = hide_responses_additions(obj, added)  # type: ignore[arg-type]
        return raw if hidden is None else whole_dumps(hidden)

    def relay(self, added: Added, take: Take, fingerprint: SeenFingerprint) -> EventRelay:
        return ResponsesEventRelay(added, take, fingerprint)  # type: ignore[arg-type]

    async def recorded_request(self, app: web.Application, body: dict) -> dict:
        return await resolve_responses_request(body, app[CHAINS])  # else from the store

    def continues(self, body: dict) -> Any:
        return body.get("previous_response_id")

    def additions_refused(self, app: web.Application, body: dict) -> None:
        refused_additions(app).add(str(body.get("model")))  # asked plainly from now on

    def answered(self, app: web.Application, capture: Any) -> None:
        """What a later `previous_response_id` continues: this conversation and its reply."""
        response_id = capture.acc.meta.get("id")
        state = capture.acc.choices.get(0)
        if response_id is None or state is None or capture.error is not None:
            return
        reply = capture.acc.response(0)["choices"][0]["message"]
        request = capture.request_body
        chain = [*request["messages"], reply]
        app[CHAINS].remember(
            response_id, chain, request.get("history_missing"), request.get("model")
        )


class Messages(Shape):
    """`/v1/messages`: nothing to ask for (vLLM gives no ids there), relayed verbatim;
    the request recorded in the chat shape."""

    endpoint = MESSAGES
    path = "/v1/messages"

    def accumulator(
        self,
        echo: bool = False,
        as_ids: bool = False,
        hidden: ResponsesAdditions | None = None,
        note: str | None = None,
    ) -> MessagesAccumulator:
        acc = MessagesAccumulator()
        acc.note = note
        return acc

    async def recorded_request(self, app: web.Application, body: dict) -> dict:
        return messages_request(body)


SHAPES: dict[str, Shape] = {
    shape.endpoint: shape
    for shape in (
        Completions(CHAT, "/v1/chat/completions", "chat"),
        Completions(TEXT, "/v1/completions", "text_completion"),
        Responses(),
        Messages(),
    )
}
