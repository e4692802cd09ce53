"""The docs keep up with the code: every option and config field is documented, every
command's help says what it does and shows an example, and the docs the README points
to exist."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from overnight.cli.main import main
from overnight.cli.options import param_name
from overnight.cli.serve import ServeConfig
from overnight.config import JudgeConfig, ProxyConfig, TrainConfig, VLLMConfig

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = sorted(main.commands.items())
COMMAND_OF = {
    ProxyConfig: "serve",
    VLLMConfig: "serve",
    ServeConfig: "serve",
    JudgeConfig: "judge",
    TrainConfig: "train",
}


def test_the_option_tables_are_generated_from_the_cli_as_it_is():
    check = subprocess.run([sys.executable, str(ROOT / "docs" / "generate_options.py"), "--check"])
    assert check.returncode == 0, "docs/configuration.md is stale: python docs/generate_options.py"


@pytest.mark.parametrize("name,command", COMMANDS)
def test_every_option_says_what_it_does(name, command):
    options = [p for p in command.params if isinstance(p, click.Option)]
    assert all(o.help and len(o.help) > 10 for o in options), [
        o.name for o in options if not o.help
    ]
    flags = [flag for o in options for flag in o.opts + o.secondary_opts]
    assert len(flags) == len(set(flags)), f"{name} has a flag twice"
    doc = (ROOT / "docs" / "configuration.md").read_text()
    section = doc.split(f"### `overnight {name}`", 1)[1].split("### ", 1)[0]
    for o in options:
        assert f"`{o.opts[0]}`" in section, f"{name} {o.opts[0]} is not in docs/configuration.md"


@pytest.mark.parametrize("config_class", list(COMMAND_OF))
def test_every_config_field_says_what_it_does_and_has_a_flag(config_class):
    """Help lives in the field's metadata; a field without a flag says so (`flag: None`)."""
    command = main.commands[COMMAND_OF[config_class]]
    params = {p.name: p for p in command.params}
    for field in dataclasses.fields(config_class):
        name = f"{config_class.__name__}.{field.name}"
        assert len(field.metadata.get("help", "")) > 10, f"{name} has no help"
        if field.metadata.get("flag", "") is None:
            continue
        assert param_name(field) in params, f"{name} has no flag on {command.name}"
        assert params[param_name(field)].help == field.metadata["help"]


@pytest.mark.parametrize("name,command", COMMANDS)
def test_every_command_help_has_a_summary_and_an_example(name, command):
    text = command.help or ""
    summary = text.strip().splitlines()[0]
    assert summary.endswith(".") and len(summary) < 90, summary
    assert "Example:" in text and f"overnight {name}" in text.split("Example:", 1)[1]
    # And the group's help lists it with that summary.
    listing = main.get_help(click.Context(main, **main.context_settings))
    assert summary.rstrip(".") in listing, f"`overnight --help` cuts {name}'s summary"


def test_the_readme_starts_with_the_two_commands_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert [line.split()[0:2] for line in first_block] == [["make", "demo"], ["make", "test"]]
    for link in re.findall(r"\]\(([^)#]+)\)", readme):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), f"README links to a missing {link}"
    for doc in ("wire.md", "grpo.md", "operations.md", "troubleshooting.md", "configuration.md"):
        assert f"docs/{doc}" in readme, f"README does not point to docs/{doc}"
