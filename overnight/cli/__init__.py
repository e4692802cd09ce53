"""The `overnight` command and its subcommands: the entry points, apart from the ground
every part stands on (overnight.config, overnight.errors, overnight.telemetry).

`main` (main.py) is the click group; data.py holds the commands that read a data
directory, adapters.py `promote` and `rollback`, policy_runs.py which policies a batch
command runs for, serve.py, demo.py and prune.py their commands, and options.py the
click options built from the config dataclasses.
"""

from .main import main

__all__ = ["main"]
