"""Which groups are a policy's: the night of one policy trains on its own traffic only.

The definition (`PolicyScope`, its SQL) lives in storage/policy_scope.py, which the
web view and `overnight ls` read too: a night trains on a group only when every record
in it asked for the policy's alias (a rollout that asked for another model is not the
policy's, whatever its group); what asked for no policy (the base model) trains the
default policy only when it is the proxy's only one.

A night of one policy also reads only its own selection record (selection.py): the
record says its policy, and a record from before policies (none said) is the default
policy's. Per-turn groups follow their served turn's group; the gate's held-out prompts
are the policy's own traffic (gate_prompts.py).
"""

from __future__ import annotations

from overnight.storage.policy_scope import PolicyScope

__all__ = ["PolicyScope"]
