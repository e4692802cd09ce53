"""Judging a night's candidate before it is served.

Owns the promotion gate (`verdict`: candidate vs served on held-out prompts, a paired
bootstrap), its held-out prompts (`prompts`, taken from outside the plan where it can) and
forgetting on a reference set (`forgetting`, `references.json`). May import `choose`,
`grpo` and `overnight.storage`; never `live` or `run`.
"""
