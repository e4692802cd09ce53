"""Shadow sampling: K more samples of a served turn, asked for once its answer was sent.

Owns the sampler (`sampler`: when a sibling may run, how it yields to served traffic,
the rows it writes) and the reassembly of a sibling's stream (`stream`). May import
`forward`, `capture`, `overnight.storage` and `overnight.config`; the routes call it,
never the other way round.
"""
