"""Watching live traffic once an adapter serves.

Owns live rewards per adapter (`rewards`) and two sides' compared (`compare`), the watch
that rolls back (`watch`), the canary (`canary`) and the hosted handover's local share
(`handover`). May import `gate` (its statistics and budgets), `choose`, `serving` and
`overnight.storage`; never `run`.
"""
