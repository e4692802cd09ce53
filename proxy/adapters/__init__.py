"""The alias and the adapters behind it: promote, drain, unload, roll back, on every replica.

Owns the registry that promotes, rolls back and follows the other proxies (`registry`),
what it serves and routes the alias by, and how a change is switched and drained
(`serving`), loads on every replica or where one is missing (`loading`), what the
promotion state holds and the offline rollback (`promotions`), where that state lives
(`state_file` on a local disk, `bucket_state` in a bucket), requests in flight per
adapter (`in_flight`), vLLM's runtime LoRA endpoints (`lora_client`) and the replicas'
health checks (`replica_check`). May import `forward` (replicas), `overnight.storage`
and `overnight.errors`; never capture, shadow or the routes.
"""
