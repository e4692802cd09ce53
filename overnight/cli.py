"""The `overnight` command line. Thin: each command parses options and calls a library.

Parts are imported inside each command so that `overnight --help` is instant and the
proxy process never imports torch. Options come from the command line, then
`OVERNIGHT_*` environment variables, then the config file (`--config`, TOML, a table
per command and top-level keys for all), then the defaults.
"""

from __future__ import annotations

import logging
import sys
import time
import tomllib
from pathlib import Path

import click

from .config import DEFAULT_DATA_DIR, JudgeConfig, ProxyConfig, TrainConfig
from .errors import OvernightError


def _load_config_file(ctx: click.Context, _param, value: str | None):
    """Turn the TOML file into click's default_map: names as on the command line."""
    if value is None:
        return None
    try:
        data = tomllib.loads(Path(value).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise click.BadParameter(f"cannot read config file {value}: {e}") from e
    group: click.Group = ctx.command  # type: ignore[assignment]
    shared = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    unknown_tables = set(tables) - set(group.commands)
    if unknown_tables:
        raise click.BadParameter(f"{value}: no command named {sorted(unknown_tables)}")
    flags = {name: _flags(command) for name, command in group.commands.items()}
    unused = set(shared) - {flag for by_flag in flags.values() for flag in by_flag}
    if unused:
        raise click.BadParameter(f"{value}: no command has an option {sorted(unused)}")
    default_map = {}
    for name, by_flag in flags.items():
        entries = {**{k: v for k, v in shared.items() if k in by_flag}, **tables.get(name, {})}
        unknown = set(entries) - set(by_flag)
        if unknown:
            raise click.BadParameter(f"{value}: [{name}] has no option {sorted(unknown)}")
        default_map[name] = {by_flag[k]: v for k, v in entries.items()}
    ctx.default_map = default_map
    return value


def _flags(command: click.Command) -> dict[str, str]:
    """`--api-key` -> `api_key`: parameter name, as config files spell options."""
    return {
        opt.lstrip("-").replace("-", "_"): param.name
        for param in command.params
        for opt in param.opts
        if opt.startswith("--")
    }


def _default(config_class, name: str):
    """A config field's default: the dataclass is the one place defaults live."""
    return config_class.__dataclass_fields__[name].default


data_option = click.option(
    "--data",
    "data_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_DATA_DIR,
    show_default=True,
    envvar="OVERNIGHT_DATA",
    help="Data directory: records, logs, adapters.",
)


@click.group(
    context_settings={
        "auto_envvar_prefix": "OVERNIGHT",
        "help_option_names": ["-h", "--help"],
        # Wide enough that `overnight --help` shows each command's whole first line.
        "terminal_width": 110,
        "max_content_width": 110,
    }
)
@click.option(
    "--config",
    type=click.Path(dir_okay=False),
    envvar="OVERNIGHT_CONFIG",
    callback=_load_config_file,
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


def _fail(e: Exception) -> click.ClickException:
    return click.ClickException(str(e))


@main.command()
@click.option("--model", help="Model to serve: vLLM is started as a child process.")
@click.option("--upstream", help="URL of an OpenAI-compatible server already running.")
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address the proxy listens on."
)
@click.option(
    "--port", default=8000, show_default=True, type=int, help="Port the proxy listens on."
)
@data_option
@click.option(
    "--alias", default="policy", show_default=True, help="Model name that follows promotions."
)
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    envvar="OVERNIGHT_API_KEYS",
    help="Accepted client key (repeatable; env OVERNIGHT_API_KEYS, space-separated).",
)
@click.option(
    "--admin-token",
    default=None,
    envvar="OVERNIGHT_ADMIN_TOKEN",
    help="Token for /admin/ (else loopback only; env OVERNIGHT_ADMIN_TOKEN).",
)
@click.option(
    "--upstream-api-key",
    default=None,
    envvar="OVERNIGHT_UPSTREAM_API_KEY",
    help="Key the proxy sends upstream (env OVERNIGHT_UPSTREAM_API_KEY).",
)
@click.option(
    "--served-model-name",
    default=None,
    help="Name vLLM serves the base model under (default: the --model value).",
)
@click.option(
    "--max-lora-rank", default=16, show_default=True, type=int, help="vLLM's --max-lora-rank."
)
@click.option("--max-loras", default=2, show_default=True, type=int, help="vLLM's --max-loras.")
@click.option(
    "--tool-call-parser",
    default="hermes",
    show_default=True,
    help="vLLM's tool call parser ('' for none).",
)
@click.option(
    "--vllm-arg",
    "vllm_args",
    multiple=True,
    help="Extra argument for vLLM (repeatable), e.g. --vllm-arg=--dtype=float32.",
)
@click.option(
    "--max-body-bytes",
    default=_default(ProxyConfig, "max_body_bytes"),
    show_default=True,
    type=int,
    help="Largest request body accepted (413 above it).",
)
@click.option(
    "--connect-timeout",
    default=_default(ProxyConfig, "connect_timeout"),
    show_default=True,
    type=float,
    help="Seconds to connect to the upstream.",
)
@click.option(
    "--read-timeout",
    default=_default(ProxyConfig, "read_timeout"),
    show_default=True,
    type=float,
    help="Longest silence between two upstream bytes (no cap on a whole generation).",
)
@click.option(
    "--keepalive-timeout",
    default=_default(ProxyConfig, "keepalive_timeout"),
    show_default=True,
    type=float,
    help="Idle upstream connections are closed after this (below vLLM's 5 s).",
)
@click.option(
    "--drain-timeout",
    default=_default(ProxyConfig, "drain_timeout"),
    show_default=True,
    type=float,
    help="How long a replaced adapter may finish requests in flight before unloading.",
)
@click.option(
    "--commit-interval",
    default=_default(ProxyConfig, "commit_interval"),
    show_default=True,
    type=float,
    help="Group commit window of the write-ahead log, seconds (fsync at most this often).",
)
@click.option(
    "--roll-seconds",
    default=_default(ProxyConfig, "roll_seconds"),
    show_default=True,
    type=float,
    help="Roll the write-ahead log into Parquet after this many seconds (or 64 MiB).",
)
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Logging of the proxy (and of vLLM's start).",
)
def serve(
    model,
    upstream,
    host,
    port,
    data_dir,
    alias,
    api_keys,
    admin_token,
    upstream_api_key,
    served_model_name,
    max_lora_rank,
    max_loras,
    tool_call_parser,
    vllm_args,
    max_body_bytes,
    connect_timeout,
    read_timeout,
    keepalive_timeout,
    drain_timeout,
    commit_interval,
    roll_seconds,
    log_level,
):
    """Serve the logging proxy (and vLLM with --model).

    \b
    Example:
      overnight serve --model ./tiny-model --port 8000 --data ./overnight-data
      overnight serve --upstream http://127.0.0.1:8001 --api-key sk-local
    """
    from .serve import serve_forever

    if bool(model) == bool(upstream):
        raise click.UsageError("give exactly one of --model (start vLLM) or --upstream URL")
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        serve_forever(
            model=model,
            upstream=upstream,
            host=host,
            port=port,
            data_dir=data_dir,
            alias=alias,
            api_keys=tuple(api_keys),
            admin_token=admin_token,
            upstream_api_key=upstream_api_key,
            served_model_name=served_model_name,
            max_lora_rank=max_lora_rank,
            max_loras=max_loras,
            tool_call_parser=tool_call_parser or None,
            vllm_args=tuple(vllm_args),
            tuning={
                "max_body_bytes": max_body_bytes,
                "connect_timeout": connect_timeout,
                "read_timeout": read_timeout,
                "keepalive_timeout": keepalive_timeout,
                "drain_timeout": drain_timeout,
                "commit_interval": commit_interval,
                "roll_seconds": roll_seconds,
            },
        )
    except OvernightError as e:
        raise _fail(e) from e


@main.command(name="ls")
@data_option
@click.option("--group", default=None, help="Only this rollout group.")
@click.option("--limit", default=20, show_default=True, type=int, help="Most recent groups shown.")
def ls_command(data_dir, group, limit):
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
def show(data_dir, rollout_id):
    """Show one rollout's conversation, turn by turn.

    \b
    Example:
      overnight show task-17.3
    """
    from .view import display

    with _db(data_dir) as con:
        try:
            click.echo(display.show_rollout(con, rollout_id))
        except OvernightError as e:
            raise _fail(e) from e


@main.command()
@data_option
@click.argument("query")
@click.option(
    "--format",
    "fmt",
    default="table",
    show_default=True,
    type=click.Choice(["table", "csv", "json"]),
    help="Output format.",
)
def sql(data_dir, query, fmt):
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
            raise _fail(e) from e


@main.command()
@data_option
@click.option(
    "--format",
    "fmt",
    default="jsonl",
    show_default=True,
    type=click.Choice(["jsonl", "parquet"]),
    help="Output format.",
)
@click.option(
    "--table",
    default="completions",
    show_default=True,
    type=click.Choice(
        ["completions", "rollouts", "groups", "rewards", "finishes", "judgments", "training_runs"]
    ),
    help="Table or view to export.",
)
@click.option(
    "--out",
    "out_path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="File to write.",
)
def export(data_dir, fmt, table, out_path):
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
@click.option(
    "--judge-model", default=None, help="litellm model string of the judge, e.g. openai/o3."
)
@click.option("--judge-base-url", default=None, help="Base URL of a self-hosted judge (with /v1).")
@click.option(
    "--judge-api-key", default=None, envvar="OVERNIGHT_JUDGE_API_KEY", help="Key for the judge."
)
@click.option(
    "--rubric",
    "rubric_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="File with the rubric (replaces the default).",
)
@click.option(
    "--reward", default=None, help="Reward function, module:function or file.py:function."
)
@click.option("--combine", is_flag=True, help="With --reward and a judge: also store their mean.")
@click.option("--rejudge", is_flag=True, help="Judge again groups this judge and rubric scored.")
@click.option(
    "--ignore-posted", is_flag=True, help="Judge groups whose rewards the agent posted, too."
)
@click.option(
    "--settle",
    default=600.0,
    show_default=True,
    type=float,
    help="Seconds without a turn after which an unfinished rollout counts as finished.",
)
@click.option("--group", "groups", multiple=True, help="Only this group (repeatable).")
@click.option("--max-groups", default=None, type=int, help="At most this many groups.")
@click.option(
    "--concurrency", default=8, show_default=True, type=int, help="Groups judged at once."
)
@click.option("--max-fixes", default=2, show_default=True, type=int, help="Corrective retries.")
@click.option(
    "--max-tokens",
    default=None,
    type=int,
    help="Cap on the judge's answer (default: the judge's own; reasoning models need room).",
)
@click.option(
    "--temperature", default=None, type=float, help="The judge's temperature (default: its own)."
)
@click.option(
    "--max-retries",
    default=_default(JudgeConfig, "max_retries"),
    show_default=True,
    type=int,
    help="Retries of one call on rate limits, timeouts and 5xx (with backoff).",
)
@click.option(
    "--timeout",
    default=_default(JudgeConfig, "timeout"),
    show_default=True,
    type=float,
    help="Seconds for one judge call.",
)
@click.option(
    "--max-tool-chars",
    default=_default(JudgeConfig, "max_tool_chars"),
    show_default=True,
    type=int,
    help="Tool outputs longer than this are shortened in the middle for the judge.",
)
def judge(
    data_dir,
    judge_model,
    judge_base_url,
    judge_api_key,
    rubric_file,
    reward,
    combine,
    rejudge,
    ignore_posted,
    settle,
    groups,
    max_groups,
    concurrency,
    max_fixes,
    max_tokens,
    temperature,
    max_retries,
    timeout,
    max_tool_chars,
):
    """Score finished groups with an LLM judge (RULER) and/or a reward function.

    \b
    Example:
      overnight judge --judge-model openai/o3
      overnight judge --judge-model openai/judge --judge-base-url http://127.0.0.1:8001/v1
      overnight judge --reward examples/rewards.py:weather_reward
    """
    import asyncio

    from .config import JudgeConfig
    from .judge.rewards import RewardFunction
    from .judge.run import run_judge

    if not judge_model and not reward:
        raise click.UsageError("give --judge-model, --reward, or both")
    if not data_dir.is_dir():
        raise click.ClickException(f"no data directory at {data_dir} (use --data)")
    if combine and not (judge_model and reward):
        raise click.UsageError("--combine needs both --judge-model and --reward")
    try:
        config = None
        if judge_model:
            config = JudgeConfig(
                model=judge_model,
                base_url=judge_base_url,
                api_key=judge_api_key,
                rubric=rubric_file.read_text() if rubric_file else "",
                concurrency=concurrency,
                max_fixes=max_fixes,
                max_tokens=max_tokens,
                temperature=temperature,
                max_retries=max_retries,
                timeout=timeout,
                max_tool_chars=max_tool_chars,
            )
        function = RewardFunction(reward) if reward else None
        summary = asyncio.run(
            run_judge(
                data_dir,
                config,
                function,
                combine=combine,
                rejudge=rejudge,
                use_posted=not ignore_posted,
                settle_seconds=settle,
                groups=list(groups) or None,
                max_groups=max_groups,
            )
        )
    except OvernightError as e:
        raise _fail(e) from e
    for line in summary.lines():
        click.echo(line)


proxy_option = click.option(
    "--proxy",
    "proxy_url",
    default="http://127.0.0.1:8000",
    show_default=True,
    envvar="OVERNIGHT_PROXY",
    help="The proxy whose adapter is trained and promoted.",
)
admin_token_option = click.option(
    "--admin-token", default=None, envvar="OVERNIGHT_ADMIN_TOKEN", help="The proxy's admin token."
)


@main.command()
@data_option
@proxy_option
@admin_token_option
@click.option(
    "--base-model", default=None, help="Base model path or name (default: ask the proxy)."
)
@click.option(
    "--learning-rate",
    default=_default(TrainConfig, "learning_rate"),
    show_default=True,
    type=float,
    help="AdamW learning rate (the tiny CPU model wants 6e-2: --preset tiny-cpu).",
)
@click.option(
    "--epochs",
    default=_default(TrainConfig, "epochs"),
    show_default=True,
    type=int,
    help="Passes over the night's groups.",
)
@click.option(
    "--lora-rank",
    default=_default(TrainConfig, "lora_rank"),
    show_default=True,
    type=int,
    help="Rank of a fresh adapter (an existing one keeps its own).",
)
@click.option(
    "--lora-alpha",
    default=None,
    type=int,
    help="Alpha of a fresh adapter (default: twice the rank).",
)
@click.option(
    "--target-module",
    "target_modules",
    multiple=True,
    help="Module a fresh adapter adapts (repeatable; default: every attention and MLP projection).",
)
@click.option(
    "--groups-per-step",
    default=_default(TrainConfig, "groups_per_step"),
    show_default=True,
    type=int,
    help="Groups per optimizer step.",
)
@click.option(
    "--micro-batch-tokens",
    default=_default(TrainConfig, "micro_batch_tokens"),
    show_default=True,
    type=int,
    help="Tokens per forward pass; gradients accumulate across passes.",
)
@click.option(
    "--max-grad-norm",
    default=_default(TrainConfig, "max_grad_norm"),
    show_default=True,
    type=float,
    help="Gradient norm clip.",
)
@click.option(
    "--scale-by-std/--no-scale-by-std",
    default=_default(TrainConfig, "scale_by_std"),
    show_default=True,
    help="Divide advantages by the group's reward standard deviation.",
)
@click.option(
    "--share-prompts/--no-share-prompts",
    default=_default(TrainConfig, "share_prompts"),
    show_default=True,
    help="Run a group's shared prompt once per row instead of once per rollout.",
)
@click.option(
    "--fsdp/--no-fsdp",
    default=_default(TrainConfig, "fsdp"),
    show_default=True,
    help="Under torchrun: shard the model per layer (FSDP) instead of copying it.",
)
@click.option(
    "--loss",
    default="dapo",
    show_default=True,
    type=click.Choice(["grpo", "dr_grpo", "dapo"]),
    help="How token losses are normalised (docs/grpo.md).",
)
@click.option(
    "--clip-low",
    default=_default(TrainConfig, "clip_low"),
    show_default=True,
    type=float,
    help="The ratio may fall to 1 - this before the clip stops the gradient.",
)
@click.option(
    "--clip-high",
    default=_default(TrainConfig, "clip_high"),
    show_default=True,
    type=float,
    help="The ratio may rise to 1 + this (DAPO's clip-higher).",
)
@click.option(
    "--dual-clip",
    default=_default(TrainConfig, "dual_clip"),
    show_default=True,
    type=float,
    help="Cap on the loss of negative-advantage tokens with huge ratios (0: off).",
)
@click.option(
    "--ratio-level",
    default=_default(TrainConfig, "ratio_level"),
    show_default=True,
    type=click.Choice(["token", "sequence"]),
    help="Importance ratio per token, or one per sequence (GSPO-style).",
)
@click.option(
    "--loss-max-tokens",
    "max_tokens",
    default=_default(TrainConfig, "max_tokens"),
    show_default=True,
    type=int,
    help="dr_grpo's constant normaliser (tokens per sequence).",
)
@click.option(
    "--kl-coef",
    default=_default(TrainConfig, "kl_coef"),
    show_default=True,
    type=float,
    help="Weight of a KL term to the base model (0: off, no reference pass).",
)
@click.option(
    "--reward-source",
    "reward_sources",
    multiple=True,
    help="Which reward to train on, in order of preference (repeatable; default: "
    "agent, combined, function, ruler).",
)
@click.option(
    "--seed",
    default=_default(TrainConfig, "seed"),
    show_default=True,
    type=int,
    help="Shuffles and init.",
)
@click.option(
    "--dtype",
    default=_default(TrainConfig, "dtype"),
    show_default=True,
    type=click.Choice(["auto", "float32", "bfloat16"]),
    help="auto: bfloat16 on GPUs that have it, else float32.",
)
@click.option(
    "--min-group-size",
    default=_default(TrainConfig, "min_group_size"),
    show_default=True,
    type=int,
    help="Smaller groups are skipped (too little relative signal).",
)
@click.option("--max-groups", default=None, type=int, help="Train on at most this many groups.")
@click.option(
    "--since",
    default=None,
    type=click.DateTime(),
    help="Only groups started at or after this time.",
)
@click.option(
    "--settle",
    default=600.0,
    show_default=True,
    type=float,
    help="Seconds idle after which an unfinished rollout counts as finished.",
)
@click.option("--judge-model", default=None, help="Score unscored groups with this judge first.")
@click.option("--judge-base-url", default=None, help="Base URL of a self-hosted judge (with /v1).")
@click.option("--reward", default=None, help="Score unscored groups with this function first.")
@click.option("--no-promote", is_flag=True, help="Save the adapter but keep serving the old one.")
@click.option("--dry-run", is_flag=True, help="Show what would be trained, and stop.")
@click.option(
    "--preset",
    type=click.Choice(["tiny-cpu"]),
    default=None,
    help="Defaults for the tiny local model on a CPU (options given explicitly still win).",
)
@click.pass_context
def train(
    ctx,
    data_dir,
    proxy_url,
    admin_token,
    base_model,
    learning_rate,
    epochs,
    lora_rank,
    lora_alpha,
    target_modules,
    groups_per_step,
    micro_batch_tokens,
    max_grad_norm,
    scale_by_std,
    share_prompts,
    fsdp,
    loss,
    clip_low,
    clip_high,
    dual_clip,
    ratio_level,
    max_tokens,
    kl_coef,
    reward_sources,
    seed,
    dtype,
    min_group_size,
    max_groups,
    since,
    settle,
    judge_model,
    judge_base_url,
    reward,
    no_promote,
    dry_run,
    preset,
):
    """Train the served LoRA adapter with GRPO on logged, scored groups, and promote it.

    \b
    Example:
      overnight train --dry-run
      overnight train --learning-rate 1e-5 --epochs 1
      crontab: 0 3 * * *  overnight train --data /var/lib/overnight >> train.log 2>&1
    """
    import datetime as dt

    from .config import TrainConfig
    from .trainer.train import train as run

    if not data_dir.is_dir():
        raise click.ClickException(f"no data directory at {data_dir} (use --data)")
    if (judge_model or reward) and not dry_run:
        # Score first, with the judge's own batch (the trainer never calls the judge).
        import asyncio

        from .config import JudgeConfig
        from .judge.rewards import RewardFunction
        from .judge.run import run_judge

        try:
            judge_config = (
                JudgeConfig(model=judge_model, base_url=judge_base_url) if judge_model else None
            )
            function = RewardFunction(reward) if reward else None
            summary = asyncio.run(
                run_judge(data_dir, judge_config, function, settle_seconds=settle)
            )
        except OvernightError as e:
            raise _fail(e) from e
        for line in summary.lines():
            click.echo(line)
    if preset == "tiny-cpu":
        from .config import TINY_CPU_PRESET

        given = {
            "learning_rate": learning_rate,
            "epochs": epochs,
            "lora_rank": lora_rank,
            "groups_per_step": groups_per_step,
        }
        for name in given:
            if ctx.get_parameter_source(name) == click.core.ParameterSource.DEFAULT:
                given[name] = TINY_CPU_PRESET[name]
        learning_rate, epochs = given["learning_rate"], given["epochs"]
        lora_rank, groups_per_step = given["lora_rank"], given["groups_per_step"]
    try:
        config = TrainConfig(
            base_model=base_model,
            learning_rate=learning_rate,
            epochs=epochs,
            lora_rank=lora_rank,
            lora_alpha=lora_alpha or 2 * lora_rank,
            **({"target_modules": tuple(target_modules)} if target_modules else {}),
            groups_per_step=groups_per_step,
            micro_batch_tokens=micro_batch_tokens,
            max_grad_norm=max_grad_norm,
            scale_by_std=scale_by_std,
            share_prompts=share_prompts,
            fsdp=fsdp,
            loss=loss,
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=dual_clip or None,
            ratio_level=ratio_level,
            max_tokens=max_tokens,
            kl_coef=kl_coef,
            **({"reward_sources": tuple(reward_sources)} if reward_sources else {}),
            seed=seed,
            dtype=dtype,
            min_group_size=min_group_size,
        )
        since_utc = since.replace(tzinfo=dt.UTC) if since else None
        run(
            data_dir,
            config,
            proxy_url=None if dry_run or not proxy_url else proxy_url,
            admin_token=admin_token,
            promote=not no_promote,
            dry_run=dry_run,
            settle_seconds=settle,
            since=since_utc,
            max_groups=max_groups,
            say=click.echo,
        )
    except OvernightError as e:
        raise _fail(e) from e


@main.command()
@data_option
@click.option("--port", default=8000, show_default=True, type=int, help="The proxy's port.")
@click.option(
    "--model-dir",
    default=".cache/tiny-model",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the tiny model is built (reused when present).",
)
@click.option(
    "--days", default=4, show_default=True, type=int, help="Days of traffic (nights: one fewer)."
)
@click.option(
    "--upstream",
    default=None,
    help="Use this running vLLM (serving the tiny model) instead of starting one.",
)
@click.option(
    "--judge-model",
    default=None,
    help="Also RULER-judge the search agent's groups with this model.",
)
@click.option("--judge-base-url", default=None, help="Base URL of a self-hosted judge (with /v1).")
def demo(data_dir, port, model_dir, days, upstream, judge_model, judge_base_url):
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

    run_demo(
        str(data_dir),
        port,
        str(model_dir),
        days=days,
        upstream=upstream,
        judge_model=judge_model,
        judge_base_url=judge_base_url,
        say=say,
    )


@main.command()
@data_option
@click.option("--limit", default=20, show_default=True, type=int, help="Most recent runs shown.")
def runs(data_dir, limit):
    """List training runs, newest first.

    \b
    Example:
      overnight runs --limit 5
    """
    from .view import display

    with _db(data_dir) as con:
        click.echo(
            display.run_query(
                con,
                (
                    "SELECT run_id, status, len(groups) AS groups, rollouts, steps, trained_tokens, "
                    "round(reward_mean, 3) AS reward_mean, promoted_as, started_at FROM training_runs "
                    f"ORDER BY started_at DESC LIMIT {int(limit)}"
                ),
                "table",
            )
        )


@main.command()
@data_option
@proxy_option
@admin_token_option
@click.option(
    "--offline",
    is_flag=True,
    help="No proxy runs: change DATA/adapters.json; the next serve restores the previous one.",
)
def rollback(data_dir, proxy_url, admin_token, offline):
    """Serve the previous adapter again (or the base model).

    \b
    Example:
      overnight rollback --proxy http://127.0.0.1:8000
      overnight rollback --data /var/lib/overnight --offline   # while the proxy is stopped
    """
    if offline:
        from .proxy.adapters import rollback_on_disk

        try:
            now = rollback_on_disk(data_dir / "adapters.json")
        except OvernightError as e:
            raise _fail(e) from e
        click.echo(
            f"the next overnight serve on {data_dir} will serve "
            f"{f'{now.path} (was {now.name})' if now else 'the base model'}"
        )
        return
    from .trainer.train import admin_call

    try:
        state = admin_call(proxy_url, "/admin/adapters/rollback", admin_token, {})
    except OvernightError as e:
        raise _fail(e) from e
    current = state.get("current")
    click.echo(
        f"the alias {state['alias']} now serves {current['name'] if current else 'the base model'}"
    )


@main.command(name="tiny-model")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--seed", default=0, show_default=True, type=int, help="Weights and tokenizer follow from it."
)
def tiny_model(out_dir, seed):
    """Build the tiny local chat model used by the demo and tests.

    \b
    Example:
      overnight tiny-model ./tiny-model
    """
    from .testing.tiny_model import build_tiny_model

    click.echo(f"tiny model in {build_tiny_model(out_dir, seed=seed)}")


class _db:
    """Open the data directory read-only for one command; clear errors if it is not one."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir

    def __enter__(self):
        from .storage import SchemaVersionError, open_db

        if not self.data_dir.is_dir():
            raise click.ClickException(f"no data directory at {self.data_dir} (use --data)")
        try:
            self.con = open_db(self.data_dir)
        except SchemaVersionError as e:
            raise _fail(e) from e
        return self.con

    def __exit__(self, *exc):
        self.con.close()


if __name__ == "__main__":
    sys.exit(main())
