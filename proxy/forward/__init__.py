"""Forwarding's ground: the hop to vLLM and the bytes on the way.

Owns the proxy's own HTTP/1.1 client (`upstream`), the choice of a replica (`balancer`),
server-sent events split from any chunks (`sse`), which paths under /v1 pass through
(`paths`) and JSON in and out of handlers (`jsonio`). Nothing here knows about
records, adapters or the app's state: it may import only `overnight.errors`.
The request handler that uses all of this to relay an answer is `routes.relay`.
"""
