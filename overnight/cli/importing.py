"""`overnight import`: the logs a team already has, as `completions` rows (docs/import.md).
`overnight/cli/main.py` adds it to the `overnight` group."""

from __future__ import annotations

from pathlib import Path

import click

from .data import data_option

FORMATS = ("openai-jsonl", "openai-batch", "litellm", "langfuse", "otel")


@click.command(name="import")
@data_option
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.option(
    "--format", "fmt", required=True, type=click.Choice(FORMATS),
    help="How SOURCE was written: openai-jsonl (request/response pairs, fine-tuning "
    "lines), openai-batch (Batch API input and output lines), litellm "
    "(StandardLoggingPayload lines), langfuse (traces and observations), otel (OTLP/JSON "
    "spans with gen_ai.* attributes).",
)  # fmt: skip
@click.option(
    "--redact", metavar="MODULE:FUNCTION",
    help="The hook `overnight serve --redact` takes, applied to each imported row.",
)  # fmt: skip
@click.option(
    "--as-policy", metavar="ALIAS",
    help="Count the imported calls as asked for this policy's alias (their model_requested), "
    "so that a night of that policy reads them where the proxy serves several; each "
    "request keeps the model it named [default: that model].",
)  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Read and count; write nothing.")
def import_command(
    data_dir: Path,
    source: Path,
    fmt: str,
    redact: str | None,
    as_policy: str | None,
    dry_run: bool,
) -> None:
    """Import another tool's logged calls as `completions` rows, marked as imported.

    SOURCE is a file or a directory, gzip or not. Importing the same source again adds nothing;
    a bad line is counted and named, never fatal; a proxy may write the same --data
    meanwhile.

    \b
    Example:
      overnight import --data ./data exports/ --format openai-jsonl
      overnight import --data ./data litellm.jsonl.gz --format litellm --dry-run
    """
    from overnight.errors import ConfigError
    from overnight.imports.run import import_source
    from overnight.imports.sources import SourceError

    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        summary = import_source(
            data_dir, source, fmt, redact=redact, dry_run=dry_run, as_policy=as_policy,
            say=lambda line: click.echo(line, err=True),
        )  # fmt: skip
    except (SourceError, ConfigError, OSError) as e:
        raise click.ClickException(str(e)) from e
    for line in summary.lines_out():
        click.echo(line)
    if summary.lost:
        raise SystemExit(1)
