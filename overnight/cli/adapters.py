"""The `overnight` commands that change what a policy's alias serves, through the proxy:
`promote` an adapter, `rollback` (or, with no proxy running, change the promotion state on
disk). Each takes `--policy` (proxy/alias/policies.py; unset: the default policy).
Kept apart from cli.py, which assembles every command (`ADAPTER_COMMANDS`).
"""

from __future__ import annotations

from pathlib import Path

import click

from .data import admin_token_option, data_option, policy_option, proxy_option
from .data import proxy_of as _proxy


@click.command()
@data_option
@proxy_option
@admin_token_option
@click.option(
    "--offline",
    is_flag=True,
    help="No proxy runs: change DATA/adapters.json; the next serve restores the previous one.",
)
@click.option("--reason", default="", help="Why: kept with the rollback, shown in /ui.")
@click.option("--canary", is_flag=True, help="Only stop the canary (the alias keeps serving).")
@policy_option
def rollback(
    data_dir: Path,
    proxy_url: str | None,
    admin_token: str | None,
    offline: bool,
    reason: str,
    canary: bool,
    policy: str | None,
) -> None:
    """Serve the previous adapter again (or the base model).

    \b
    Example:
      overnight rollback --proxy http://127.0.0.1:8000 --reason "answers got longer"
      overnight rollback --data /var/lib/overnight --offline   # while the proxy is stopped
      overnight rollback --canary --reason "not now"   # drop the canary only
      overnight rollback --policy support   # that policy's alias only
    """
    said = f" ({reason})" if reason else ""
    if offline:
        if canary:
            raise click.UsageError("--canary needs the proxy: without one no canary is served")
        from overnight.proxy.alias.promotions import offline_state_path, rollback_on_disk

        now = rollback_on_disk(offline_state_path(data_dir, policy), reason, data_dir)
        served = f"{now.path} (was {now.name})" if now else "the base model"
        click.echo(f"the next overnight serve on {data_dir} will serve {served}{said}")
        return
    from overnight.trainer.serving.proxy_client import admin_call

    url = _proxy(data_dir, proxy_url)
    if url is None:
        raise click.UsageError("--proxy is empty: give the proxy's URL, or use --offline")
    payload = {"reason": reason, **({"canary": True} if canary else {})}
    state = admin_call(url, "/admin/adapters/rollback", admin_token, payload, policy)
    current = state.get("current")
    served = current["name"] if current else "the base model"
    what = "dropped the canary; " if canary else ""
    click.echo(f"{what}the alias {state['alias']} now serves {served}{said}")


@click.command()
@data_option
@proxy_option
@admin_token_option
@click.argument("adapter", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--canary",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    help="Serve it to this share of the alias's rollouts only (promote it again: to all).",
)
@click.option("--reason", default="", help="Why: kept with the promotion, shown in /ui.")
@policy_option
def promote(
    data_dir: Path,
    proxy_url: str | None,
    admin_token: str | None,
    adapter: Path,
    canary: float | None,
    reason: str,
    policy: str | None,
) -> None:
    """Serve a LoRA adapter (a peft directory) under a policy's alias, on every replica.

    \b
    Example:
      overnight promote ./adapters/20260101-030000-ab12cd
      overnight promote ./my-adapter --policy support --reason "trained by hand"
      overnight promote ./candidate --canary 0.1   # a tenth of the rollouts first
    """
    from overnight.trainer.serving.proxy_client import admin_call

    url = _proxy(data_dir, proxy_url)
    if url is None:
        raise click.UsageError("--proxy is empty: a promotion goes through the proxy")
    payload = {"path": str(adapter.resolve()), "reason": reason}
    if canary is not None:
        payload["canary"] = canary
    state = admin_call(url, "/admin/adapters/promote", admin_token, payload, policy)
    share = f" to {canary:.0%} of its rollouts" if canary is not None else ""
    click.echo(f"the alias {state['alias']} now serves {state['promoted']}{share}")


ADAPTER_COMMANDS = [promote, rollback]
