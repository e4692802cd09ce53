"""Which paths under /v1 pass through to vLLM, and which never do.

vLLM 0.32 serves inference and read routes beside administrative ones: with runtime
LoRA on, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` answer anyone who
reaches them, and its RL and dev routes (pause, sleep, weight updates, profiling,
cache resets) sit at the root. The proxy sends its own upstream key, so forwarding
such a call would let a client key change what is served behind the alias while
`/admin/adapters` reports otherwise. So the pass-through forwards an allowlist
(decided from vLLM 0.32's routes) and nothing else; the admin API is the only way to
change what is served. A path with a `.` or `..` segment, plain or percent-encoded,
never reaches the upstream (the URL would be normalised to somewhere outside /v1).
"""

from __future__ import annotations

import re

from overnight.errors import OvernightError

GET, POST = frozenset({"GET", "HEAD"}), frozenset({"POST"})

# Tails under /v1 that are inference or reads. Completions are the proxy's own routes;
# a GET on them lands here and gets 405.
FORWARDED: dict[str, frozenset[str]] = {
    "models": GET,
    "chat/completions": POST,
    "completions": POST,
    "embeddings": POST,
    "responses": POST,
    "messages": POST,
    "messages/count_tokens": POST,
    "score": POST,
    "rerank": POST,
    "tokenize": POST,
    "detokenize": POST,
    "pooling": POST,
    "classify": POST,
    "audio/transcriptions": POST,
    "audio/translations": POST,
    "chat/completions/render": POST,
    "completions/render": POST,
    "responses/render": POST,
    "messages/render": POST,
}
# One id segment: GET /v1/responses/{id}, POST /v1/responses/{id}/cancel.
_RESPONSE = re.compile(r"responses/([A-Za-z0-9_.:-]+)(/cancel)?")

# vLLM's administrative routes, named so that the refusal can say why. Any tail not
# forwarded is refused; these get 403 rather than 404.
ADMINISTRATIVE = frozenset(
    {
        "load_lora_adapter",
        "unload_lora_adapter",
        "pause",
        "resume",
        "is_paused",
        "sleep",
        "wake_up",
        "is_sleeping",
        "collective_rpc",
        "start_profile",
        "stop_profile",
        "reset_prefix_cache",
        "reset_mm_cache",
        "reset_encoder_cache",
        "release_kv_cache_memory",
        "update_weights",
        "start_weight_update",
        "finish_weight_update",
        "start_draft_weight_update",
        "update_weight_version",
        "init_weight_transfer_engine",
        "shutdown_weight_transfer_engine",
        "weight_checker",
        "abort_requests",
        "scale_elastic_ep",
        "is_scaling_elastic_ep",
    }
)


class PathRefused(OvernightError):
    status = 404
    code = "not_found"


def check_forwarded(tail: str, method: str) -> None:
    """Raise unless `method /v1/{tail}` may go upstream; `tail` is the decoded path."""
    if any(segment in (".", "..") for segment in tail.split("/")):
        raise PathRefused(
            "a path with '.' or '..' segments is refused", status=400, code="invalid_path"
        )
    methods = FORWARDED.get(tail)
    if methods is None:
        m = _RESPONSE.fullmatch(tail)
        if m is not None:
            methods = POST if m.group(2) else GET
    if methods is None:
        if tail.strip("/") in ADMINISTRATIVE:
            raise PathRefused(
                f"/v1/{tail} is an administrative route of the upstream; the proxy's admin API "
                "(/admin/) is the only way to change what is served",
                status=403,
                code="forbidden_path",
            )
        raise PathRefused(f"no route /v1/{tail} (the proxy forwards inference and read routes)")
    if method not in methods:
        raise PathRefused(
            f"{method} is not allowed on /v1/{tail}", status=405, code="method_not_allowed"
        )
