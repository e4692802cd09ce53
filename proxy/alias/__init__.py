"""What each policy's alias serves, and the one way that changes: promote, drain, roll back.

The registry (`registry`) promotes on every replica or none, rolls back, and follows the
other proxies; the promotion state's parts and the offline rollback (`promotions`), where
that state lives (`state_file` on a local disk, `bucket_state` in a bucket), several
policies behind one proxy (`policies`), which adapters are a policy's own (`ownership`),
and which adapters stay on disk (`retention`). May import `replicas`, `forward`,
`overnight.storage` and `overnight.errors`; never capture, shadow or the routes.
"""
