"""`python -m overnight.cli`: the `overnight` command."""

import sys

from .main import main

sys.exit(main())
