"""Command-line conveniences: --show-config (the config that runs) and --defaults on every sub-command that
takes a config, eval's policy check, --version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from qevolve.cli import app

ROOT = Path(__file__).resolve().parents[1]

CONFIGURED = {
    ("bc",): "data.train_path",
    ("critic",): "iql.expectile",
    ("dpo",): "beta",
    ("label",): "estimator",
    ("policy",): "standardize_advantages",
    ("rollout",): "agent.batch_size",
    ("eval",): "agent.max_turns",
    ("evolve",): "iterations",
}


@pytest.mark.parametrize("command, field", sorted(CONFIGURED.items()))
def test_every_configured_sub_command_shows_its_config(command, field):
    # critic and label have required options: --show-config works without them
    section, _, name = field.rpartition(".")
    for flags in (["--show-config"], ["--show-config", "--defaults"]):
        extra = ["--checkpoint", "default"] if command == ("eval",) else []
        result = CliRunner().invoke(app, [*command, *flags, *extra])
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        assert lines[0].startswith(f"# qevolve {command[0]}: ") and max(map(len, lines)) <= 100
        assert f"{'  ' if section else ''}{name}: " in result.output and (not section or f"\n{section.split('.')[0]}:\n"
                                                                            in result.output)
        assert yaml.safe_load(result.output) is not None  # commented YAML, loadable


def _shown(args):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 100, "lines wider than 100 columns"
    return result.output, yaml.safe_load(result.output)


def test_show_config_shows_the_config_file_and_overrides_applied():
    quick = str(ROOT / "configs/cpu/webshop-quick.yaml")
    text, shown = _shown(["evolve", "--show-config", "--config", quick, "eval.limit=7", "policy.epochs=2"])
    assert shown["env"] == "webshop" and shown["name"] == "cpu-webshop-quick" and shown["eval"]["limit"] == 7
    assert shown["policy"]["epochs"] == 2 and shown["model"]["lora"]["enabled"] is False
    assert "# environment (default: alfworld)\nenv: webshop" in text  # the default beside a changed value
    # the fields the loop decides are not listed as settings, but say what decides them
    assert "model" not in shown["bc"] and "seed" not in shown["policy"] and "env" not in shown["bc"]["data"]
    assert "  # model: set from model (the loop sets bc.model from model)" in text
    assert shown["bc"]["data"]["num_demonstrations"] == 32  # a settable nested field stays listed
    from qevolve.config import load_config
    from qevolve.evolve.loop import EvolveConfig
    assert EvolveConfig.model_validate(shown) == load_config(EvolveConfig, quick, ["eval.limit=7", "policy.epochs=2"])

    _, defaults = _shown(["evolve", "--show-config", "--defaults", "--config", quick])
    assert defaults["env"] == "alfworld" and defaults["model"]["lora"]["enabled"] is True
    _, bc = _shown(["bc", "--show-config", "--config", str(ROOT / "configs/bc.yaml"), "optim.lr=0.5"])
    assert bc["optim"]["lr"] == 0.5 and bc["data"]["num_demonstrations"] == 300


def test_show_config_refuses_what_a_run_would_refuse(tmp_path):
    result = CliRunner().invoke(app, ["evolve", "--show-config", "bc.model.lora.enabled=false"])
    assert result.exit_code != 0 and "set model.lora.enabled instead" in str(result.exception)


def test_critic_and_label_name_their_missing_options():
    for args, option in ((["critic"], "--buffer"), (["label", "--buffer", "b.parquet"], "--critic")):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and f"error: {option}: required" in result.output


def test_version():
    import re

    result = CliRunner().invoke(app, ["--version"])
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert result.exit_code == 0 and result.output.strip() == f"qevolve {version}"


def test_eval_without_a_policy_is_an_error_not_the_base_model():
    result = CliRunner().invoke(app, ["eval", "--limit", "1"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and "error: no policy to evaluate: pass --checkpoint" in result.output


def test_eval_starts_from_the_evaluation_a_saved_policy_records(tmp_path):
    """A policy of `qevolve evolve` records the run's evaluation; `qevolve eval` shows (and runs) it, and
    options and overrides still win."""
    from qevolve.config import load_config
    from qevolve.evolve.loop import EvolveConfig, record_evaluation

    policy = tmp_path / "iter_1" / "policy" / "final"
    policy.mkdir(parents=True)
    (policy / "qevolve_policy.json").write_text(json.dumps({"lora": False}))
    run = load_config(EvolveConfig, ROOT / "configs/cpu/webshop-quick.yaml", ["eval.splits=[test, train]",
                                                                             "num_threads=1"])
    record_evaluation(policy, run, "iter_1")
    _, shown = _shown(["eval", "--checkpoint", str(policy), "--show-config"])
    assert (shown["env"], shown["split"], shown["limit"], shown["source"]) == ("webshop", "test", 50, "eval")
    assert shown["agent"]["max_new_tokens"] == 96 and shown["agent"]["max_turns"] == 10
    assert shown["prompt"]["max_prompt_tokens"] == 3072 and shown["model"]["name_or_path"] == str(policy)
    assert shown["model"]["lora"]["enabled"] is False and shown["model"]["num_threads"] == 1
    from qevolve.seeding import derive_seed
    assert shown["agent"]["seed"] == derive_seed(0, "iter_1/eval_test")
    _, chosen = _shown(["eval", "--checkpoint", str(policy), "--show-config", "--split", "train", "--limit", "3",
                        "agent.max_new_tokens=5"])
    assert (chosen["split"], chosen["limit"], chosen["agent"]["max_new_tokens"]) == ("train", 3, 5)
    assert chosen["agent"]["seed"] == derive_seed(0, "iter_1/eval_train") and chosen["env"] == "webshop"
    # a policy without a record (e.g. a base model folder): the defaults, as before
    _, plain = _shown(["eval", "--checkpoint", str(tmp_path), "--show-config"])
    assert (plain["env"], plain["split"]) == ("alfworld", "train")


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
            assert "--show-config" in options and "--defaults" in options, path
            assert path in CONFIGURED, path
