"""The `overnight` command line. Thin: each command parses options and calls a library.

Parts are imported inside each command so that `overnight --help` is instant and the
proxy process never imports torch. Options come from the command line, then
`OVERNIGHT_*` environment variables, then the config file (`--config`, TOML, a table
per command and top-level keys for all), then the defaults. The config dataclasses'
options are built from their fields (overnight/options.py); a command's own are below.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from .config import SETTLE_SECONDS, JudgeConfig, ProxyConfig, TrainConfig, VLLMConfig
from .errors import OvernightError
from .options import build, config_options, load_config_file
from .serve import ServeConfig


class _Group(click.Group):
    """Every command's errors of the project's own kind become a one-line message."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OvernightError as e:
            raise click.ClickException(str(e)) from e


@click.group(
    cls=_Group,
    context_settings={
        "auto_envvar_prefix": "OVERNIGHT",
        "help_option_names": ["-h", "--help"],
        # Wide enough that `overnight --help` shows each command's whole first line.
        "terminal_width": 110,
        "max_content_width": 110,
    },
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    envvar="OVERNIGHT_CONFIG",
    callback=load_config_file,
    is_eager=True,
    expose_value=False,
    help="TOML file of option defaults ([serve], [ls], ... tables; top-level keys for all).",
)
@click.version_option(package_name="overnight")
def main() -> None:
    """An OpenAI-compatible logging proxy in front of vLLM that trains offline.

    \b
    Example:
      overnight serve --model Qwen/Qwen2.5-7B-Instruct --port 8000
      OPENAI_BASE_URL=http://localhost:8000/v1 python my_agent.py
      overnight ls
    """


_TABLES = ("completions", "rollouts", "groups", "rewards", "finishes", "judgments", "training_runs")

# Options several commands take.
data_option = config_options(ProxyConfig, only=["data_dir"])
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


def _format_option(*formats: str) -> Callable[[Callable], Callable]:
    """`--format`, the first of `formats` by default."""
    return click.option(
        "--format", "fmt", default=formats[0], show_default=True, type=click.Choice(formats),
        help="Output format.",
    )  # fmt: skip


@main.command()
@config_options(VLLMConfig)
@config_options(ProxyConfig)
@config_options(ServeConfig)
def serve(**values: Any) -> None:
    """Serve the logging proxy (and vLLM with --model).

    \b
    Example:
      overnight serve --model ./tiny-model --port 8000 --data ./overnight-data
      overnight serve --upstream http://127.0.0.1:8001 --api-key sk-local
    """
    if bool(values["model"]) == bool(values["upstream"]):
        raise click.UsageError("give exactly one of --model (start vLLM) or --upstream URL")
    from .proxy.launcher import free_port
    from .serve import serve_forever

    listen = build(ServeConfig, values)
    logging.basicConfig(
        level=listen.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    vllm = None
    if values["model"]:
        log_path = values["data_dir"] / "logs" / "vllm.log"
        vllm = build(VLLMConfig, values, port=free_port(), log_path=log_path)
        values["upstream"] = vllm.url
    proxy = build(ProxyConfig, values)
    if vllm is None:  # started here, vLLM gets --logprobs-mode processed_logprobs
        from .proxy.launcher import check_logprobs_mode

        for upstream in proxy.upstreams:
            ok, line = check_logprobs_mode(upstream, proxy.upstream_api_key)
            logging.getLogger("overnight").log(logging.INFO if ok else logging.WARNING, line)
    serve_forever(proxy, vllm, listen.host, listen.port, workers=listen.workers)


@main.command(name="ls")
@data_option
@click.option("--group", help="Only this rollout group.")
@click.option("--limit", default=20, show_default=True, help="Most recent groups shown.")
def ls_command(data_dir: Path, group: str | None, limit: int) -> None:
    """List rollout groups and their rollouts, newest first.

    \b
    Example:
      overnight ls --limit 5
    """
    from .view import display

    with _db(data_dir) as con:
        click.echo(display.list_groups(con, group=group, limit=limit))


@main.command()
@data_option
@click.argument("rollout_id")
def show(data_dir: Path, rollout_id: str) -> None:
    """Show one rollout's conversation, turn by turn.

    \b
    Example:
      overnight show task-17.3
    """
    from .view import display

    with _db(data_dir) as con:
        click.echo(display.show_rollout(con, rollout_id))


@main.command()
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

    from .view import display

    with _db(data_dir) as con:
        try:
            click.echo(display.run_query(con, query, fmt))
        except duckdb.Error as e:
            raise click.ClickException(str(e)) from e


@main.command()
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
    from .view import display

    with _db(data_dir) as con:
        n = display.export(con, table, fmt, out_path)
    click.echo(f"wrote {n} row(s) of {table} to {out_path}")


@main.command()
@data_option
@config_options(JudgeConfig)
@click.option("--reward", help="Reward function, module:function or file.py:function.")
@click.option("--combine", is_flag=True, help="With --reward and a judge: also store their mean.")
@click.option("--rejudge", is_flag=True, help="Judge again groups this judge and rubric scored.")
@click.option(
    "--ignore-posted", is_flag=True, help="Judge groups whose rewards the agent posted, too."
)
@settle_option
@click.option("--group", "groups", multiple=True, help="Only this group (repeatable).")
@click.option("--max-groups", type=int, help="At most this many groups.")
def judge(data_dir: Path, reward: str | None, combine: bool, **values: Any) -> None:
    """Score finished groups with an LLM judge (RULER) and/or a reward function.

    \b
    Example:
      overnight judge --judge-model openai/o3
      overnight judge --judge-model openai/judge --judge-base-url http://127.0.0.1:8001/v1
      overnight judge --reward examples/rewards.py:weather_reward
    """
    judge_model = values["judge_model"]
    if not judge_model and not reward:
        raise click.UsageError("give --judge-model, --reward, or both")
    _require(data_dir)
    if combine and not (judge_model and reward):
        raise click.UsageError("--combine needs both --judge-model and --reward")
    from .judge.run import judge_step

    judge_step(
        data_dir,
        build(JudgeConfig, values) if judge_model else None,
        reward,
        say=click.echo,
        combine=combine,
        rejudge=values["rejudge"],
        use_posted=not values["ignore_posted"],
        settle_seconds=values["settle"],
        groups=list(values["groups"]) or None,
        max_groups=values["max_groups"],
    )


@main.command()
@data_option
@proxy_option
@admin_token_option
@config_options(TrainConfig)
@click.option("--max-groups", type=int, help="Train on at most this many groups.")
@click.option("--since", type=click.DateTime(), help="Only groups started at or after this time.")
@settle_option
@click.option("--judge-model", help="Score unscored groups with this judge first.")
@config_options(JudgeConfig, only=["base_url"])
@click.option("--reward", help="Score unscored groups with this function first.")
@click.option("--no-promote", is_flag=True, help="Save the adapter but keep serving the old one.")
@click.option("--dry-run", is_flag=True, help="Show what would be trained, and stop.")
@click.option(
    "--preset",
    type=click.Choice(["tiny-cpu"]),
    help="Defaults for the tiny local model on a CPU (options given explicitly still win).",
)
@click.pass_context
def train(ctx: click.Context, data_dir: Path, reward: str | None, **values: Any) -> None:
    """Train the served LoRA adapter with GRPO on logged, scored groups, and promote it.

    \b
    Example:
      overnight train --dry-run
      overnight train --learning-rate 1e-5 --epochs 1
      crontab: 0 3 * * *  overnight train --data /var/lib/overnight >> train.log 2>&1
    """
    import datetime as dt

    _require(data_dir)
    dry_run = values["dry_run"]
    model, base_url = values["judge_model"], values["judge_base_url"]
    judge = JudgeConfig(model=model, base_url=base_url) if model else None
    if (values["judge_model"] or reward) and not dry_run:
        # Score first, with the judge's own batch (the trainer never calls the judge).
        from .judge.run import judge_step

        judge_step(data_dir, judge, reward, say=click.echo, settle_seconds=values["settle"])
    if values["preset"] == "tiny-cpu":
        from .config import TINY_CPU_PRESET

        for name, value in TINY_CPU_PRESET.items():
            if ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT:
                values[name] = value
    from .trainer.train import train as run

    since = values["since"]
    run(
        data_dir,
        build(TrainConfig, values),
        proxy_url=None if dry_run else _proxy(data_dir, values["proxy_url"]),
        admin_token=values["admin_token"],
        promote=not values["no_promote"],
        dry_run=dry_run,
        settle_seconds=values["settle"],
        since=since.replace(tzinfo=dt.UTC) if since else None,
        max_groups=values["max_groups"],
        say=click.echo,
        scorer=gate_scorer(reward, judge),
    )


def gate_scorer(reward: str | None, judge: JudgeConfig | None):
    """The promotion gate's scorer (trainer/gate.py `Scorer`): the reward function when
    one is given, else RULER; None without either. Built here because the trainer never
    imports the judge."""
    if reward is None and judge is None:
        return None
    from .judge.trajectories import Group, Trajectory

    def group_of(messages: list[dict], tools: list[dict], replies: list[dict]) -> Group:
        return Group(
            "gate", [Trajectory(f"gate.{i}", [*messages, r], tools) for i, r in enumerate(replies)]
        )

    if reward is not None:
        from .judge.rewards import RewardFunction

        function = RewardFunction(reward)

        async def by_function(messages, tools, replies) -> list[float]:
            scores = await function.score_group(group_of(messages, tools, replies))
            return [scores[f"gate.{i}"] for i in range(len(replies))]

        return by_function
    from .judge.ruler import judge_group

    async def by_judge(messages, tools, replies) -> list[float]:
        if all(r == replies[0] for r in replies):
            return [0.0] * len(replies)  # the same reply twice: a tie, no call
        judgment = await judge_group(group_of(messages, tools, replies), judge)
        if judgment.error:
            raise OvernightError(f"the judge failed: {judgment.error}")
        return [judgment.scores[f"gate.{i}"][0] for i in range(len(replies))]

    return by_judge


@main.command()
@data_option
@proxy_option
@admin_token_option
@config_options(TrainConfig, only=["watch_min_rollouts", "reward_sources", "seed"])
@click.option("--dry-run", is_flag=True, help="Say what the watch finds; roll nothing back.")
def watch(
    data_dir: Path, proxy_url: str | None, admin_token: str | None, dry_run: bool, **values: Any
) -> None:
    """Roll back the promoted adapter if live rewards show it worse than its predecessor.

    \b
    Example:
      overnight watch --proxy http://127.0.0.1:8000
      crontab: */30 * * * *  overnight watch --data /var/lib/overnight >> watch.log 2>&1
    """
    _require(data_dir)
    url = _proxy(data_dir, proxy_url)
    if url is None:
        raise click.UsageError("--proxy is empty: the watch rolls back through the proxy")
    from .trainer.watch import watch as run_watch

    run_watch(data_dir, url, admin_token, build(TrainConfig, values), click.echo, not dry_run)


@main.command()
@data_option
@click.option("--port", default=8000, show_default=True, help="The proxy's port.")
@click.option(
    "--model-dir",
    default=".cache/tiny-model",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the tiny model is built (reused when present).",
)
@click.option("--days", default=4, show_default=True, help="Days of traffic (nights: one fewer).")
@click.option(
    "--upstream", help="Use this running vLLM (serving the tiny model) instead of starting one."
)
@click.option("--judge-model", help="Also RULER-judge the search agent's groups with this model.")
@config_options(JudgeConfig, only=["base_url"])
def demo(data_dir: Path, port: int, model_dir: Path, days: int, **values: Any) -> None:
    """Run the whole story on a tiny local model: traffic by day, GRPO by night.

    Builds the tiny model, starts vLLM (CPU) and the proxy, runs the example agents
    through it, and each night scores, trains and promotes; prints the mean reward
    day by day and where the report is. A few minutes on 2 cores.

    \b
    Example:
      overnight demo
      overnight demo --days 3 --judge-model openai/gpt-4.1-mini
    """
    from .demo import run_demo

    if days < 2:
        raise click.UsageError("--days must be at least 2 (a night needs a day before and after)")

    def say(message: str) -> None:
        click.echo(f"[demo {time.strftime('%H:%M:%S')}] {message}")

    run_demo(str(data_dir), port, str(model_dir), days=days, say=say, **values)


@main.command()
@data_option
@click.option("--limit", default=20, show_default=True, help="Most recent runs shown.")
def runs(data_dir: Path, limit: int) -> None:
    """List training runs, newest first.

    \b
    Example:
      overnight runs --limit 5
    """
    from .view import display

    with _db(data_dir) as con:
        click.echo(display.list_runs(con, limit))


@main.command()
@data_option
@proxy_option
@admin_token_option
@click.option(
    "--offline",
    is_flag=True,
    help="No proxy runs: change DATA/adapters.json; the next serve restores the previous one.",
)
def rollback(data_dir: Path, proxy_url: str | None, admin_token: str | None, offline: bool) -> None:
    """Serve the previous adapter again (or the base model).

    \b
    Example:
      overnight rollback --proxy http://127.0.0.1:8000
      overnight rollback --data /var/lib/overnight --offline   # while the proxy is stopped
    """
    if offline:
        from .proxy.adapters import rollback_on_disk

        now = rollback_on_disk(data_dir / "adapters.json")
        served = f"{now.path} (was {now.name})" if now else "the base model"
        click.echo(f"the next overnight serve on {data_dir} will serve {served}")
        return
    from .trainer.proxy_client import admin_call

    url = _proxy(data_dir, proxy_url)
    if url is None:
        raise click.UsageError("--proxy is empty: give the proxy's URL, or use --offline")
    state = admin_call(url, "/admin/adapters/rollback", admin_token, {})
    current = state.get("current")
    served = current["name"] if current else "the base model"
    click.echo(f"the alias {state['alias']} now serves {served}")


@main.command()
@data_option
@click.option(
    "--older-than",
    required=True,
    help="Delete the days that ended longer ago than this: 30d, 12h, 2w.",
)
@click.option("--yes", is_flag=True, help="Delete; without it, only say what would be deleted.")
def prune(data_dir: Path, older_than: str, yes: bool) -> None:
    """Delete old day partitions of the records (never the live log nor today's).

    \b
    Example:
      overnight prune --older-than 30d          # what would go
      overnight prune --older-than 30d --yes    # delete it
    """
    from .prune import parse_age, plan_prune
    from .prune import prune as delete

    _require(data_dir)
    plan = plan_prune(data_dir, parse_age(older_than))
    for line in plan.lines():
        click.echo(line)
    if plan.empty:
        click.echo("nothing to delete")
    elif yes:
        click.echo(f"deleted {delete(plan)} day partition(s)")
    else:
        click.echo("nothing deleted: run again with --yes to delete these")


@main.command(name="tiny-model")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", default=0, show_default=True, help="Weights and tokenizer follow from it.")
def tiny_model(out_dir: Path, seed: int) -> None:
    """Build the tiny local chat model used by the demo and tests.

    \b
    Example:
      overnight tiny-model ./tiny-model
    """
    from .testing.tiny_model import build_tiny_model

    click.echo(f"tiny model in {build_tiny_model(out_dir, seed=seed)}")


def _proxy(data_dir: Path, given: str | None) -> str | None:
    """--proxy (or OVERNIGHT_PROXY; `--proxy ""`: none), else the live proxy serving
    `data_dir`, else port 8000."""
    if given is not None:
        return given or None
    from .proxy.address import find_proxy

    found = find_proxy(data_dir)
    if found is None:
        return DEFAULT_PROXY
    click.echo(f"using the proxy at {found['url']} (from {data_dir / 'proxy.json'})", err=True)
    return found["url"]


def _require(data_dir: Path) -> None:
    if not data_dir.is_dir():
        raise click.ClickException(f"no data directory at {data_dir} (use --data)")


@contextlib.contextmanager
def _db(data_dir: Path) -> Iterator[Any]:
    """The data directory opened read-only for one command; clear errors if it is not one."""
    from .storage import SchemaVersionError, open_db

    _require(data_dir)
    try:
        con = open_db(data_dir)
    except SchemaVersionError as e:
        raise click.ClickException(str(e)) from e
    try:
        yield con
    finally:
        con.close()


if __name__ == "__main__":
    sys.exit(main())
