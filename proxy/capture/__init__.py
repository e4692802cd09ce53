"""Capture: what the proxy asks vLLM for, hides again, and records.

Owns one shape per API family, what differs between them (`shapes`), the fields the
proxy adds and the accumulators that rebuild an answer from its chunks (`chat` for chat
and text completions, `apis` for the Responses and Messages APIs), a stream's events
relayed with the additions hidden (`events`), one conversation shape for every API and
Responses chains (`conversation`), which rollout a request belongs to (`attribution`),
what one request keeps while it passes (`captures`), the rows it becomes (`records`),
the redaction hook (`redact`) and output forwarded but not recorded (`uncaptured`). May
import `alias` (a record names the adapter that served it), `overnight.storage` and
`overnight.errors`; never the routes or shadow sampling.
"""
