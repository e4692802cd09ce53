"""`overnight import`: the logs a team already has, as `completions` rows (docs/import.md).

An entry point beside the CLI (it may use storage and the proxy's capture helpers, and
nothing below imports it): `sources.py` streams a file, a directory or gzip as lines or
documents; one module per format reads them as `Call`s (`openai.py`: openai-jsonl and
openai-batch; `litellm.py`; `otel.py`; `langfuse.py`); `calls.py` turns a `Call` into its
row, marked as imported; `run.py` writes the rows through a LogWriter of its own (the
proxy's log files are never touched), leaving out those already stored.
"""
