"""One run's mechanics: the training loop, what it keeps on disk, and its record.

Owns the loop over GRPO steps (`loop`: load the policy, step, checkpoint, save the
adapter), an interrupted run's resumption (`checkpoint`: run directories, checkpoints,
kill points for the tests) and the run's row in `training_runs` (`record`). May import
`grpo`, `choose` and `gate` (a run trains a plan and records the gate's verdict) and
`overnight.storage`; neither of them imports it.
"""
