"""The proxy: forwarding, attribution, capture, the admin API and the vLLM launcher.

`app` assembles it; `state` names the keys the handlers read; `address` says where a
running proxy is; `vllm_sleep` holds vLLM asleep for a colocated night. Sub-packages,
lowest first: `forward` (the hop to vLLM), `replicas` (the adapters on each replica),
`alias` (what each policy's alias serves), `capture` (what is recorded), `shadow`
(siblings of served turns), `routes` (the handlers), and `launch` (vLLM as a child).
Never imports torch or litellm: the process that serves traffic stays small.
"""

from .app import create_app

__all__ = ["create_app"]
