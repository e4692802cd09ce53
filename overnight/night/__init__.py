"""A night across policies, outside the command line.

`overnight train` (and anything else that runs a night: cron, a supervisor, a test) hands
this package typed values (policies.py) and it runs the night's steps (run.py): the
signals once, then each policy's resampling, scoring, training, gate, promotion and
record. Scoring lives in scoring.py. It sits at the entry-point layer beside
`overnight.cli`: it may import the judge and the trainer, and no part imports it.
"""
