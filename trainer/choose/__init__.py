"""What a night trains on: the plan, and why other groups wait.

Owns the plan (`plan`: finished, scored, untrained groups; an --sft night's: `sft_plan`),
the selection record (`selection`), per-turn groups from single calls (`turn_groups`,
`resample`), lone turns against the night's pool (`lone_turns`), each record's age
(`staleness`) and a vision-language model's turns (`images`). May import `grpo`,
`serving` (resampling asks vLLM through the proxy) and `overnight.storage`; never
`gate`, `live` or `run`.
"""
