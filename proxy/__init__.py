"""The proxy: forwarding, attribution, capture, the admin API and the vLLM launcher.

`app` assembles it; `state` names the keys the handlers read; `address` says where a
running proxy is. Sub-packages, lowest first: `forward` (the hop to vLLM), `adapters`
(the alias and its adapters), `capture` (what is recorded), `shadow` (siblings of
served turns), `routes` (the handlers), and `launch` (vLLM as a child process).
Never imports torch or litellm: the process that serves traffic stays small.
"""

from .app import create_app

__all__ = ["create_app"]
