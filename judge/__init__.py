"""Judge: RULER (an LLM ranks the rollouts of a group) and reward functions.

Imports litellm only when a judge is actually called: it is slow to import and
fetches a cost map from the internet unless told otherwise (see `overnight.cli`).
"""

import os

# Never reach the internet by accident: litellm otherwise downloads its cost map at import.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
