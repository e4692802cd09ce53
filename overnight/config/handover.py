"""A hosted model beside the local vLLM, for the handover (issue 28, part 3).

With `--hosted-upstream URL` the proxy fronts both: the local vLLM (`--upstream`, kind
vllm) and a hosted API, whose model (`--upstream-model`) answers each policy's rollouts
outside the handover's share (proxy/routes/handover.py; the share is the promotion
state's, moved by `overnight watch`). The two hops never share a credential: vLLM gets
`--upstream-api-key` and the proxy's additions, the hosted API gets `--hosted-api-key`
and the client's request as sent.

These fields are ProxyConfig's (it inherits them); the check runs in its __post_init__.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .upstream_kind import AUTO, HOSTED_KINDS, VLLM, check_upstream_url


@dataclass(frozen=True)
class HostedBeside:
    hosted_upstream: str | None = field(
        default=None,
        metadata={
            "help": "A hosted API served beside vLLM for the handover: each policy's "
            "rollouts outside its handover share go to it, as --upstream-model."
        },
    )
    hosted_kind: str = field(
        default="openai",
        metadata={
            "help": "What --hosted-upstream is: openai (OpenAI-compatible) or anthropic.",
            "choices": HOSTED_KINDS,
        },
    )
    # Never vLLM's key (--upstream-api-key), nor the client's.
    hosted_api_key: str | None = field(
        default=None,
        metadata={
            "help": "Key --hosted-upstream gets (env OVERNIGHT_HOSTED_API_KEY).",
            "envvar": "OVERNIGHT_HOSTED_API_KEY",
        },
    )


def check_hosted_beside(config: Any) -> None:
    """Refuse a hosted upstream beside one that is not vLLM, or without a model to ask for.
    `config`: the ProxyConfig being made (not named: proxy.py imports this)."""
    url = config.hosted_upstream
    if url is None:
        return
    url = url.rstrip("/").removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"hosted_upstream must be an http(s) URL, got {url!r}")
    check_upstream_url(url)
    object.__setattr__(config, "hosted_upstream", url)
    kind = config.hosted_kind.lower()
    if kind not in HOSTED_KINDS:
        raise ConfigError(f"hosted_kind must be one of {', '.join(HOSTED_KINDS)}, got {kind!r}")
    object.__setattr__(config, "hosted_kind", kind)
    if config.upstream_kind == AUTO:  # beside a hosted one, the local upstream is vLLM
        object.__setattr__(config, "upstream_kind", VLLM)
    if config.upstream_kind != VLLM:
        raise ConfigError(
            "a hosted upstream beside the local one (--hosted-upstream) needs --upstream to "
            f"be vLLM (--upstream-kind vllm), not {config.upstream_kind}: the handover moves "
            "traffic from the hosted model to the local one"
        )
    if not config.upstream_model:
        raise ConfigError(
            "--hosted-upstream needs --upstream-model: the hosted model a policy's rollouts "
            "outside its handover share are sent as"
        )
    if url in config.upstreams:
        raise ConfigError(f"{url} is both an --upstream and the --hosted-upstream")
