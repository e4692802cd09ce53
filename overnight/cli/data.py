"""The commands that read and tend a data directory: `ls`, `show`, `sql`, `export`,
`runs`, `prune`, `check`; and the helpers every command uses to open one. `overnight/cli/main.py`
adds these commands to the `overnight` group."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from overnight.config import SETTLE_SECONDS, ProxyConfig

from .options import config_options

_DATA_OPTIONS = config_options(ProxyConfig, only=["data_dir", "local_dir"])

DEFAULT_PROXY = "http://127.0.0.1:8000"
proxy_option = click.option(
    "--proxy", "proxy_url", envvar="OVERNIGHT_PROXY",
    help="The proxy whose adapter is trained and promoted [default: the one serving --data "
    f"(DATA/proxy.json), else {DEFAULT_PROXY}].",
)  # fmt: skip
admin_token_option = click.option(
    "--admin-token", envvar="OVERNIGHT_ADMIN_TOKEN", help="The proxy's admin token."
)
settle_option = click.option(
    "--settle",
    default=SETTLE_SECONDS,
    show_default=True,
    help="Seconds without a turn after which an unfinished rollout counts as finished.",
)
# One of the proxy's policies (proxy/alias/policies.py); unset: the default one.
policy_option = click.option(
    "--policy",
    help="The policy (an alias the proxy serves) this is about [default: the proxy's default "
    "policy, --alias].",
)


def proxy_of(data_dir: Path, given: str | None, fallback: str | None = DEFAULT_PROXY) -> str | None:
    """--proxy (or OVERNIGHT_PROXY; `--proxy ""`: none), else the live proxy serving
    `data_dir`, else `fallback` (port 8000)."""
    if given is not None:
        return given or None
    from overnight.proxy.address import find_proxy

    found = find_proxy(data_dir)
    if found is None:
        return fallback
    click.echo(f"using the proxy at {found['url']} (from {data_dir / 'proxy.json'})", err=True)
    return found["url"]


def data_option(command: Callable) -> Callable:
    """`--data` (and `--local-dir`) for a command: the command gets `data_dir`, always a
    local directory; a URL is attached to its local directory first (storage/location.py)."""
    command = _DATA_OPTIONS(command)
    for param in command.__click_params__:  # type: ignore[attr-defined]
        if param.name == "local_dir":  # read first, given to --data's callback, not passed on
            param.is_eager, param.expose_value, param.callback = True, False, _remember_local
        elif param.name == "data_dir":
            param.type, param.callback, param.metavar = click.STRING, _attach, "DIR|URL"
    return command


def _remember_local(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    ctx.meta["overnight.local_dir"] = value


def _attach(ctx: click.Context, _param: click.Parameter, value: str | Path) -> Path:
    from overnight.storage.location import StoreLocationError, attach

    try:
        return attach(value, ctx.meta.get("overnight.local_dir"))
    except (StoreLocationError, OSError) as e:
        raise click.BadParameter(str(e), param_hint="--data") from e


_TABLES = (
    "completions", "rollouts", "groups", "rewards", "finishes", "judgments", "training_runs",
    "signals",
)  # fmt: skip


def _format_option(*formats: str) -> Callable[[Callable], Callable]:
    """`--format`, the first of `formats` by default."""
    return click.option(
        "--format", "fmt", default=formats[0], show_default=True, type=click.Choice(formats),
        help="Output format.",
    )  # fmt: skip


def require_data_dir(data_dir: Path) -> None:
    if not data_dir.is_dir():
        raise click.ClickException(f"no data directory at {data_dir} (use --data)")


@contextlib.contextmanager
def read_db(data_dir: Path) -> Iterator[Any]:
    """The data directory opened read-only for one command; clear errors if it is not one,
    or if a query fails in a damaged file (`read_failure` names it)."""
    import duckdb

    from overnight.storage import SchemaVersionError, open_db
    from overnight.storage.read.reader import read_failure

    require_data_dir(data_dir)
    try:
        con = open_db(data_dir)
    except SchemaVersionError as e:
        raise click.ClickException(str(e)) from e
    except OSError as e:  # a bucket that cannot be reached, or refuses us
        raise click.ClickException(f"cannot read the records of {data_dir}: {e}") from e
    try:
        yield con
    except OSError as e:  # a bucket that stopped answering mid-query
        raise click.ClickException(f"cannot read the records of {data_dir}: {e}") from e
    except duckdb.Error as e:
        raise click.ClickException(read_failure(data_dir, e)) from e
    finally:
        con.close()


@click.command(name="ls")
@data_option
@click.option("--group", help="Only this rollout group.")
@click.option("--limit", default=20, show_default=True, help="Most recent groups shown.")
@click.option("--policy", help="Only groups that asked for this policy's alias.")
@click.option(
    "--sent-by",
    default="client",
    show_default=True,
    help="Whose groups: client (the agents'), own (overnight's own: the demo's held-out "
    "measurement, a judge through the proxy, ...), one kind of those (eval, judge, ...), or all.",
)
def ls_command(
    data_dir: Path, group: str | None, limit: int, policy: str | None, sent_by: str
) -> None:
    """List rollout groups and their rollouts, newest first: the agents' by default.

    \b
    Example:
      overnight ls --limit 5
      overnight ls --policy support
      overnight ls --sent-by own
    """
    from overnight.storage.read.sent_by import shown
    from overnight.view import display

    try:
        shown("sent_by", sent_by)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--sent-by") from None
    with read_db(data_dir) as con:
        click.echo(
            display.list_groups(con, group=group, limit=limit, policy=policy, sent_by=sent_by)
        )


@click.command()
@data_option
@click.argument("rollout_id")
def show(data_dir: Path, rollout_id: str) -> None:
    """Show one rollout's conversation, turn by turn.

    \b
    Example:
      overnight show task-17.3
    """
    from overnight.view import display

    with read_db(data_dir) as con:
        click.echo(display.show_rollout(con, rollout_id, data_dir))


@click.command()
@data_option
@click.argument("query")
@_format_option("table", "csv", "json")
def sql(data_dir: Path, query: str, fmt: str) -> None:
    """Run a DuckDB query over the views completions, rollouts, groups, rewards, finishes.

    \b
    Example:
      overnight sql "SELECT group_id, mean_reward FROM groups ORDER BY started_at DESC"
    """
    import duckdb

    from overnight.storage.read.reader import read_failure
    from overnight.view import display

    with read_db(data_dir) as con:
        try:
            click.echo(display.run_query(con, query, fmt))
        except duckdb.Error as e:  # only the tables it names are verified
            raise click.ClickException(read_failure(data_dir, e, query)) from e


@click.command()
@data_option
@_format_option("jsonl", "parquet")
@click.option(
    "--table",
    default="completions",
    show_default=True,
    type=click.Choice(_TABLES),
    help="Table or view to export.",
)
@click.option(
    "--out",
    "out_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="File to write.",
)
def export(data_dir: Path, fmt: str, table: str, out_path: Path) -> None:
    """Export a table or view to JSON lines or Parquet.

    \b
    Example:
      overnight export --format jsonl --out completions.jsonl
    """
    from overnight.view import display

    with read_db(data_dir) as con:
        n = display.export(con, table, fmt, out_path)
    click.echo(f"wrote {n} row(s) of {table} to {out_path}")


@click.command()
@data_option
@click.option("--limit", default=20, show_default=True, help="Most recent runs shown.")
@click.option("--policy", help="Only this policy's runs and adapter events.")
def runs(data_dir: Path, limit: int, policy: str | None) -> None:
    """List training runs, newest first, with the policy each trained.

    \b
    Example:
      overnight runs --limit 5
      overnight runs --policy support
    """
    from overnight.view import display
    from overnight.view.cycles import cycle_line

    with read_db(data_dir) as con:
        events = display.adapter_events(data_dir, policy)
        click.echo(display.list_runs(con, limit, events, policy=policy))
        cycles = cycle_line(con, policy)  # how often the loop turned, and how it ended
        if cycles:
            click.echo(cycles)


@click.command()
@data_option
@click.option("--older-than", help="Delete the days that ended longer ago than this: 30d, 12h, 2w.")
@click.option(
    "--adapters",
    is_flag=True,
    help="Delete the adapters no longer needed too: all but the served one, a canary, the "
    "previous --keep-adapters of the promotion stack, the gate's best so far, and any a "
    "replica has loaded.",
)
@click.option(
    "--keep-adapters", default=5, show_default=True, type=click.IntRange(min=0),
    help="With --adapters: the rollback targets kept (the previous N of the stack).",
)  # fmt: skip
@proxy_option
@admin_token_option
@click.option("--yes", is_flag=True, help="Delete; without it, only say what would be deleted.")
def prune(
    data_dir: Path, older_than: str | None, adapters: bool, keep_adapters: int,
    proxy_url: str | None, admin_token: str | None, yes: bool,
) -> None:  # fmt: skip
    """Delete old day partitions of the records, and adapters no longer needed.

    Never the live log nor today's partition; never the served adapter, a canary, the
    rollback targets, or one a replica has loaded.

    \b
    Example:
      overnight prune --older-than 30d          # what would go
      overnight prune --older-than 30d --yes    # delete it
      overnight prune --adapters --keep-adapters 3 --yes
    """
    require_data_dir(data_dir)
    if older_than is None and not adapters:
        raise click.UsageError("say what to prune: --older-than AGE, --adapters, or both")
    if older_than is not None:
        _prune_days(data_dir, older_than, yes)
    if older_than is not None or adapters:
        # With --older-than alone, adapters are pruned where that is safe here, else said.
        _prune_adapters(data_dir, keep_adapters, proxy_of(data_dir, proxy_url, None),
                        admin_token, yes, required=adapters)  # fmt: skip


def _prune_days(data_dir: Path, older_than: str, yes: bool) -> None:
    from .prune import parse_age, plan_prune
    from .prune import prune as delete

    plan = plan_prune(data_dir, parse_age(older_than))
    for line in plan.lines():
        click.echo(line)
    if plan.empty:
        click.echo("nothing to delete")
    elif yes:
        click.echo(f"deleted {delete(plan)} day partition(s)")
        if plan.rewritten:
            click.echo(f"rewrote {plan.rewritten} merged week(s)/month(s) without the older days")
        if plan.images is not None and plan.images.unreferenced:
            click.echo(f"deleted {len(plan.images.unreferenced)} image(s) no row references "
                       f"({plan.images.bytes:,} bytes)")  # fmt: skip
    else:
        click.echo("nothing deleted: run again with --yes to delete these")


def _prune_adapters(
    data_dir: Path, keep: int, proxy_url: str | None, token: str | None, yes: bool,
    required: bool = True,
) -> None:  # fmt: skip
    """Through the proxy serving the data directory (it knows what its replicas loaded,
    and deletes under its promotion locks), else offline under the state file's lock.
    Not `required` (prune --older-than alone): a bucket without a proxy is said, not fatal."""
    from overnight.storage.location import segment_store

    if proxy_url is None and not required and segment_store(data_dir).url is not None:
        click.echo("adapters: not pruned (with a bucket, give --proxy URL: another machine's "
                   "proxy may be loading one)")  # fmt: skip
        return
    if proxy_url is not None:
        from overnight.trainer.serving.proxy_client import admin_call

        pruned = admin_call(proxy_url, "/admin/adapters/prune", token,
                            {"keep": keep, "dry_run": not yes})  # fmt: skip
        from overnight.proxy.alias.retention import Pruned

        lines = Pruned(**pruned).lines()
    else:
        from overnight.proxy.alias.retention import prune_offline

        lines = prune_offline(data_dir, keep, dry_run=not yes).lines()
    for line in lines:
        click.echo(line)
    if not yes:
        click.echo("nothing deleted: run again with --yes to delete these")


@click.command()
@data_option
@click.option(
    "--quarantine", is_flag=True,
    help="Set each damaged file aside (quarantine/files/), out of every reader's view.",
)  # fmt: skip
def check(data_dir: Path, quarantine: bool) -> None:
    """Verify every file and manifest of the records; exit 1 on damage.

    Checksums, footers, manifest entries, live logs, stored images (their bytes against
    their names), rows stored twice. What to do for each finding: docs/operations.md,
    "Damaged files".

    \b
    Example:
      overnight check                 # report
      overnight check --quarantine    # and set damaged files aside
    """
    from overnight.storage.upkeep.check import check_store

    require_data_dir(data_dir)
    report = check_store(data_dir, quarantine=quarantine)
    for line in report.lines():
        click.echo(line)
    if report.damaged:
        raise SystemExit(1)


COMMANDS = [ls_command, show, sql, export, runs, prune, check]
