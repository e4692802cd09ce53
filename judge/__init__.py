"""Judge: RULER (an LLM ranks the rollouts of a group) and reward functions.

Imports litellm only when a judge is actually called (`import_litellm`, used by the
prompt's budget and by the judge's call alike): it is slow to import and fetches a cost
map from the internet unless told otherwise.
"""

import os

# Never reach the internet by accident: litellm otherwise downloads its cost map at import.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def import_litellm():
    """litellm, quiet: it takes ~3 s to import, so only the judge batch pays for it."""
    import litellm

    litellm.suppress_debug_info = True
    return litellm
