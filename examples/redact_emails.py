"""A redaction hook that masks e-mail addresses in what the proxy stores.

    overnight serve --model ./tiny-model --redact examples/redact_emails.py:redact

Every string in the request and the response (message contents, tool arguments,
anything) has its e-mail addresses replaced by `[email]`. Token ids and logprobs spell
the original text, so a record in which something was masked keeps neither: the
trainer re-tokenises its masked text (less exact than the ids vLLM sampled, and said
so in the plan). Records with nothing to mask keep everything.
"""

from __future__ import annotations

import re
from typing import Any

EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
MASK = "[email]"


def redact(record: dict) -> dict:
    """The record's parts with every e-mail address masked (see overnight.proxy.capture.redact)."""
    request, found_in_request = mask(record["request"])
    response, found_in_response = mask(record["response"])
    if not (found_in_request or found_in_response):
        return {}  # nothing to mask: store the record as it is
    return {
        "request": request,
        "response": response,
        "prompt_token_ids": None,
        "completion_token_ids": None,
        "completion_logprobs": None,
    }


def mask(value: Any) -> tuple[Any, bool]:
    """A copy of `value` with addresses masked in every string, and whether any was."""
    if isinstance(value, str):
        masked = EMAIL.sub(MASK, value)
        return masked, masked != value
    if isinstance(value, dict):
        pairs = [(k, mask(v)) for k, v in value.items()]
        return {k: v for k, (v, _) in pairs}, any(found for _, (_, found) in pairs)
    if isinstance(value, list):
        items = [mask(v) for v in value]
        return [v for v, _ in items], any(found for _, found in items)
    return value, False
