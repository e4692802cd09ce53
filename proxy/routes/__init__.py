"""What clients call: the request handlers and the middleware in front of them.

Owns the agents' API (`agent_api`: completions, rewards, finishing a rollout), the
relay of a request to vLLM and of its answer back (`relay`), the admin API (`admin`)
and who may call what (`auth`). Reads the app's state through `proxy.state`'s keys; may
import every other sub-package of the proxy. Only `proxy.app` imports it.
"""
