"""What kind of server the proxy fronts: vLLM, or a hosted API (issue 28).

A hosted OpenAI-compatible API (OpenAI, a gateway in front of Gemini, Together,
Fireworks, OpenRouter) or the Anthropic Messages API refuses the fields the proxy asks
vLLM for (`return_token_ids`, `logprobs`: 400 naming the field), has no runtime LoRA
and no sleep routes. Against one the proxy adds nothing, loads no adapter and sends the
key the operator chose (`upstream_auth`).

`auto` is settled here where the URL says it (an https URL of a host below: hosted, no
request made); any other URL is asked once at `overnight serve`'s start
(launch/launcher.py `detect_kind`: vLLM's /v1/models says `owned_by: "vllm"`), and an
upstream that cannot be asked is taken for vLLM, as before kinds existed: a proxy's
start never depends on a hosted API answering with a key it may not have.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from ..errors import ConfigError

VLLM, OPENAI, ANTHROPIC, AUTO = "vllm", "openai", "anthropic", "auto"
KINDS = (AUTO, VLLM, OPENAI, ANTHROPIC)
HOSTED_KINDS = (OPENAI, ANTHROPIC)
CLIENT, CONFIGURED = "client", "configured"
AUTH_MODES = (CONFIGURED, CLIENT)

# Hosts that are hosted APIs whatever they would answer: never asked at start.
KNOWN_HOSTS = {
    "api.openai.com": OPENAI,
    "api.anthropic.com": ANTHROPIC,
    "openrouter.ai": OPENAI,
    "api.together.xyz": OPENAI,
    "api.fireworks.ai": OPENAI,
    "generativelanguage.googleapis.com": OPENAI,
}


def kind_of_url(url: str) -> str | None:
    """The kind an upstream's URL alone says (an https URL of a known host), else None."""
    parts = urlsplit(url)
    if parts.scheme != "https":
        return None
    return KNOWN_HOSTS.get((parts.hostname or "").lower())


def check_upstream_url(url: str) -> None:
    """Refuse an upstream URL that carries a secret: the hop sends its path only (no user,
    password or query: forward/upstream.py), while every "upstream ... unreachable" error,
    its record and the log name the URL. The message does not repeat the URL."""
    parts = urlsplit(url)
    if "@" in parts.netloc or parts.query:
        raise ConfigError(
            f"an upstream URL ({parts.scheme}://{parts.hostname or ''}) takes no user, "
            "password or query, which the proxy would never send: give the key with "
            "--upstream-api-key (env OVERNIGHT_UPSTREAM_API_KEY)"
        )


def upstream_label(kind: str, url: str) -> str:
    """How a record names its upstream: the kind and the host (with a port that is not
    the scheme's), never a user, a password, a path or a query."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    default = 443 if parts.scheme == "https" else 80
    port = parts.port
    return f"{kind} {host}" if port in (None, default) else f"{kind} {host}:{port}"


def check_upstream_kind(config: Any) -> None:
    """Settle `auto` from the URL where it can, and refuse what a hosted upstream cannot
    do. `config` is the ProxyConfig being made (its __post_init__ calls this, and again
    once `detect_kind` settled it: a replace); not named, as proxy.py imports this."""
    kind, auth = config.upstream_kind.lower(), config.upstream_auth.lower()
    if kind not in KINDS:
        raise ConfigError(f"upstream_kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if auth not in AUTH_MODES:
        raise ConfigError(f"upstream_auth must be one of {', '.join(AUTH_MODES)}, got {auth!r}")
    if kind == AUTO:
        kinds = {kind_of_url(url) for url in config.upstreams}
        kind = kinds.pop() if len(kinds) == 1 and None not in kinds else AUTO
    object.__setattr__(config, "upstream_kind", kind)
    object.__setattr__(config, "upstream_auth", auth)
    if kind not in HOSTED_KINDS:
        if auth == CLIENT and kind == VLLM:
            raise ConfigError(
                "upstream_auth client forwards the client's own key to a hosted API; a vLLM "
                "upstream gets --upstream-api-key (upstream_auth configured)"
            )
        return
    if len(config.upstreams) > 1:
        raise ConfigError(f"a hosted upstream ({kind}) is one URL, got {list(config.upstreams)}")
    if auth == CLIENT and config.upstream_api_key:
        raise ConfigError(
            "upstream_auth client forwards the client's key and never the configured one: "
            "give --upstream-api-key or --upstream-auth client, not both"
        )
    if config.shadow_samples:
        raise ConfigError(
            "shadow sampling asks vLLM for siblings by token ids; a hosted upstream has none"
        )
