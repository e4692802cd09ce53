"""The trainer's side of what the proxy serves, over HTTP only (never the proxy's imports).

Owns the admin API's calls (`proxy_client`: what is served, promote, prune) and a
colocated night's maintenance window (`colocation`: vLLM asleep while training holds the
GPU). Imports nothing else of the trainer.
"""
