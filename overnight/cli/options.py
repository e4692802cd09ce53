"""Click options built from config dataclasses, so that each option is declared once.

A field becomes `--field-name` with the type of its annotation and the default of the
dataclass; `bool` becomes `--x/--no-x`, `tuple[...]` a repeatable option, `X | None`
an option whose absence means None. Its metadata says the rest (TRL's configs carry
`field(metadata={"help": ...})` the same way):

    help     what the option does (required)
    flag     the flag, when it is not `--` + name (`--api-key` for `api_keys`); None: no flag
    name     the parameter's name, when it is not the field's; it names the environment
             variable `OVERNIGHT_<COMMAND>_<NAME>` and the callback's keyword
    envvar   a documented environment variable instead (`OVERNIGHT_DATA`)
    choices  the values accepted (case-insensitive)
    file     True: the option names a file and the field gets its text

`build` turns the parsed values back into the config object. `load_config_file` reads
`overnight --config FILE` into the defaults of every command's options.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
_TYPES = {str: click.STRING, int: click.INT, float: click.FLOAT}


def config_options(cls: type, *, only: Iterable[str] | None = None) -> Callable[[F], F]:
    """A decorator adding one option per field of `cls` (or of `only`), in field order."""
    hints = typing.get_type_hints(cls)
    wanted = [
        f for f in dataclasses.fields(cls) if _has_flag(f) and (only is None or f.name in only)
    ]
    options = [_option(f, hints[f.name]) for f in wanted]

    def decorate(command: F) -> F:
        for option in reversed(options):  # click lists the last decorator applied first
            command = option(command)
        return command

    return decorate


def build(cls: type[T], values: Mapping[str, Any], **overrides: Any) -> T:
    """`cls` from a command's parsed values; fields without a value keep their default
    (a required field without one is the caller's to check first)."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        name = param_name(f)
        if f.name in overrides:
            kwargs[f.name] = overrides[f.name]
        elif _has_flag(f) and name in values:
            value = values[name]
            if f.metadata.get("file") and value is not None:
                value = Path(value).read_text()
            if value is not None or _optional(hints[f.name]):
                kwargs[f.name] = value
    return cls(**kwargs)


def load_config_file(ctx: click.Context, _param, value: str | None):
    """The `--config` callback: the TOML file becomes click's default_map, keyed as on the
    command line (`api_key` for `--api-key`), a table per command, top-level keys for
    every command that has the option. Unknown keys and tables are errors."""
    if value is None:
        return None
    try:
        data = tomllib.loads(Path(value).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise click.BadParameter(f"cannot read config file {value}: {e}") from e
    group: click.Group = ctx.command  # type: ignore[assignment]
    shared = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    policies = _policy_tables(group, value, tables.pop(POLICY_TABLES, {}))
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
        # A repeatable option given once in the file (`upstream = "http://..."`) is a
        # list of one, as if the flag had been given once.
        repeatable = {p.name for p in group.commands[name].params if getattr(p, "multiple", False)}
        default_map[name] = {
            by_flag[k]: [v] if by_flag[k] in repeatable and isinstance(v, str) else v
            for k, v in entries.items()
        }
    if policies:
        # Each table names a policy `overnight serve` serves (beside --policy's), and its
        # own options for the nights (`policy_options`).
        serve = default_map.setdefault("serve", {})
        named = serve.get("policies") or []
        serve["policies"] = [*named, *(p for p in policies if p not in named)]
    ctx.meta[POLICY_TABLES] = policies
    ctx.default_map = default_map
    return value


# `[policies.NAME]` in the config file: a policy, with its own `overnight train` options.
POLICY_TABLES = "policies"


def _policy_tables(group: click.Group, where: str, tables: object) -> dict[str, dict[str, Any]]:
    """policy -> {parameter: value} from `[policies.NAME]` tables, their keys spelled as
    `overnight train`'s and `overnight judge`'s options (a policy's reward function,
    judge, rubric, gate, canary, ...)."""
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise click.BadParameter(f"{where}: [policies] holds one table per policy: [policies.NAME]")
    from overnight.config import JudgeConfig, TrainConfig

    # A night's own options: training's, and its scoring's (each policy's groups are
    # scored with its own judge or reward function: overnight/cli/policy_runs.py).
    fields = {param_name(f) for c in (TrainConfig, JudgeConfig) for f in dataclasses.fields(c)}
    fields = (fields | {"reward", "gate_reward"}) - {"policy"}
    commands = [group.commands["train"], group.commands["judge"]]
    by_flag = {k: v for c in commands for k, v in _flags(c).items() if v in fields}
    repeatable = {p.name for c in commands for p in c.params if getattr(p, "multiple", False)}
    out = {}
    for name, entries in tables.items():
        unknown = sorted(set(entries) - set(by_flag))
        if unknown:
            raise click.BadParameter(
                f"{where}: [policies.{name}] has no option {unknown} of a night's "
                "(`overnight train`'s and `overnight judge`'s options)"
            )
        # A repeatable option as click gives it: a tuple (one value in the file: of one).
        out[name] = {
            by_flag[k]: (tuple([v] if isinstance(v, str) else v) if by_flag[k] in repeatable else v)
            for k, v in entries.items()
        }
    return out


def policy_options(ctx: click.Context, policy: str | None) -> dict[str, Any]:
    """The options the config file's `[policies.POLICY]` gives a night of `policy`, less
    those given on the command line or in the environment (which win, as everywhere)."""
    given = ctx.find_root().meta.get(POLICY_TABLES, {}).get(policy, {}) if policy else {}
    explicit = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    return {k: v for k, v in given.items() if ctx.get_parameter_source(k) not in explicit}


def _flags(command: click.Command) -> dict[str, str]:
    """`--api-key` -> `api_key`: parameter name, as config files spell options."""
    return {
        opt.lstrip("-").replace("-", "_"): param.name
        for param in command.params
        for opt in param.opts
        if opt.startswith("--")
    }


def param_name(f: dataclasses.Field) -> str:
    """The click parameter a field becomes (the callback's keyword)."""
    return f.metadata.get("name", f.name)


def _has_flag(f: dataclasses.Field) -> bool:
    return f.metadata.get("flag", "") is not None


def _optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _option(f: dataclasses.Field, hint: Any) -> Callable[[F], F]:
    meta = f.metadata
    name = param_name(f)
    flag = meta.get("flag") or "--" + name.replace("_", "-")
    base = (
        next(a for a in typing.get_args(hint) if a is not type(None)) if _optional(hint) else hint
    )
    default = None if f.default is dataclasses.MISSING else f.default
    kwargs: dict[str, Any] = {"help": meta["help"], "envvar": meta.get("envvar")}
    if meta.get("file"):
        kwargs["type"] = click.Path(dir_okay=False, exists=True, path_type=Path)
        default = None  # the field's own default stands for "no file"
    elif base is bool:
        flag = f"{flag}/--no-{flag[2:]}"
    elif typing.get_origin(base) is tuple:
        kwargs.update(multiple=True, type=_TYPES[typing.get_args(base)[0]])
    elif "choices" in meta:
        kwargs["type"] = click.Choice(meta["choices"], case_sensitive=False)
    elif base is Path:  # every Path a command takes is a directory
        kwargs["type"] = click.Path(file_okay=False, path_type=Path)
    else:
        kwargs["type"] = _TYPES[base]
    # A repeatable option's default is not worth a line of help; None shows nothing.
    kwargs["show_default"] = default is not None and not kwargs.get("multiple")
    return click.option(flag, name, default=default, **kwargs)
