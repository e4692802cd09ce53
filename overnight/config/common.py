"""The defaults more than one part reads, so that the parts agree on them.

`DEFAULT_DATA_DIR` is every command's `--data`; `SETTLE_SECONDS` is when the judge, the
trainer and their commands count a rollout without `finish` as finished;
`DEFAULT_TOOL_CALL_PARSER` is the parser vLLM is started with (vllm.py) and the one the
judge reads siblings with (judge.py).
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_DATA_DIR = Path("overnight-data")
# A rollout with no `finish` counts as finished after this many idle seconds: long
# enough for an agent's slowest tool call, short enough for a nightly batch.
SETTLE_SECONDS = 600.0


# The tool call parser `overnight serve --model` starts vLLM with, and the one the judge
# reads siblings' tool calls with unless told otherwise (judge/tool_calls.py): one name,
# so that the two agree by default.
DEFAULT_TOOL_CALL_PARSER = "hermes"
