"""The night's decisions: what to train on, whether to promote, whether to roll back.

Owns the plan (`plan`: finished, scored, untrained groups and why others wait; an --sft
night's: `sft_plan`),
per-turn groups from single calls (`turn_groups`, `resample`), the promotion gate
(`gate`), the canary and the watch (`canary`, `watch`, on what live traffic says:
`live`) and the proxy's admin API (`proxy_client`). May import `grpo` and
`overnight.storage`; `grpo` never imports it, and neither imports `run`.
"""
