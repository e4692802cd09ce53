"""The proxy: forwarding, attribution, capture, the admin API and the vLLM launcher.

Never imports torch or litellm: the process that serves traffic stays small.
"""

from .app import create_app

__all__ = ["create_app"]
