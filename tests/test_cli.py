"""Command-line conveniences: --show-config on every sub-command that takes a config."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from qevolve.cli import app

CONFIGURED = {
    ("bc",): "data.train_path",
    ("critic",): "iql.expectile",
    ("label",): "estimator",
    ("policy",): "standardize_advantages",
    ("rollout",): "agent.batch_size",
    ("eval",): "agent.max_turns",
    ("evolve",): "iterations",
}


@pytest.mark.parametrize("command, field", sorted(CONFIGURED.items()))
def test_every_configured_sub_command_shows_its_config(command, field):
    # critic and label have required options: --show-config works without them
    result = CliRunner().invoke(app, [*command, "--show-config"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("| field") and f"| {field} " in result.output


def test_every_sub_command_with_a_config_option_has_show_config():
    import typer.main

    group = typer.main.get_command(app)

    def walk(command, path=()):
        if hasattr(command, "commands"):
            for name, sub in command.commands.items():
                yield from walk(sub, (*path, name))
        else:
            yield path, command

    for path, command in walk(group):
        options = {opt for param in command.params for opt in getattr(param, "opts", [])}
        if "--config" in options:
            assert "--show-config" in options, path
            assert path in CONFIGURED, path
