"""The proxy: forwarding, attribution, capture, the admin API and the vLLM launcher.

`app` assembles it; `state` names the keys the handlers read; `address` says where a
running proxy is; `vllm_sleep` holds vLLM asleep for a colocated night. Sub-packages,
lowest first: `forward` (the hop to vLLM), `replicas` (the adapters on each replica),
`alias` (what each policy's alias serves), `capture` (what is recorded), `shadow`
(siblings of served turns), `routes` (the handlers), and `launch` (vLLM as a child).
Never imports torch or litellm: the process that serves traffic stays small.
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    # Imported when asked for, not with the package: `launch` is read by processes that
    # serve no traffic (vLLM's own, loading vllm_cpu_lora as a plugin) and need none of
    # the app's imports (aiohttp, DuckDB, pyarrow: 0.8 s a process).
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
