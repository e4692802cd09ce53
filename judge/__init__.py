"""Judge: RULER and reward functions (see the judge issue)."""
