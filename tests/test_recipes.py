"""Recipes: a method of one's own, registered by name and run by ``baselines`` over the loop's stages, and
the checks of the registry (an unknown name, a name taken twice, ``--show-config``'s list)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qevolve.buffer.store import write_episodes
from qevolve.cli import app
from qevolve.config import ConfigError, load_config
from qevolve.evolve.loop import EvolveConfig, run_evolve
from qevolve.evolve.recipes import RECIPES, Run, Start, evaluate, main_critic_read, register_recipe
from qevolve.evolve.stages import rft_stage

ENV = "qevolve.environments.testing:QuietCounterEnv"


@pytest.fixture
def rft_twice():
    """The recipe of the recipes module's docstring: RFT, then RFT again from its policy."""

    @register_recipe("rft_twice")
    def recipe(run: Run, start: Start) -> None:
        """RFT, then RFT again from its policy."""
        prefix = f"{start.iteration}/rft_twice"
        first = run.stage(f"{prefix}/first", rft_stage, {"buffer": start.buffer, "start": start.policy})
        second = run.stage(f"{prefix}/policy", rft_stage, {"buffer": start.buffer,
                                                           "start": run.path(first.outputs["policy"])})
        evaluate(run, prefix, run.path(second.outputs["policy"]))

    yield recipe
    del RECIPES["rft_twice"]


@pytest.fixture(scope="module")
def overrides(tmp_path_factory, tiny_model_dir):
    from qevolve.environments.episodes import EpisodeJob
    from qevolve.environments.play import play_jobs
    from qevolve.environments.policies import WalkthroughPolicy

    folder = tmp_path_factory.mktemp("recipes")
    jobs = [EpisodeJob(f"count-{n}", WalkthroughPolicy(), split="train", episode_id=f"expert/{n}") for n in range(1, 4)]
    experts = folder / "experts.parquet"
    write_episodes(experts, play_jobs(ENV, jobs, split="train", num_workers=1, progress=False).episodes)
    trainer = ["max_steps=1", "grad_accum_steps=1", "tensorboard=false"]
    return [
        f"env={ENV}", "iterations=1", "progress=false", "num_threads=1", "tensorboard=false",
        f"model.name_or_path={tiny_model_dir}", "model.precision=fp32", "model.device=cpu",
        "prompt.max_prompt_tokens=512", "prompt.reserve_action_tokens=16",
        f"bc.data.train_path={experts}", "bc.tokens_per_batch=2048", *(f"bc.{o}" for o in trainer),
        "rollout.tasks=buffer_experts", "rollout.agent.max_turns=2", "rollout.agent.max_new_tokens=8",
        "eval.splits=[seen]", "eval.limit=1", "eval.agent.max_turns=2", "eval.agent.max_new_tokens=8",
        f"buffer.expert_path={experts}", "label.estimator=outcome", "probe.states=0",
        "policy.tokens_per_batch=2048", *(f"policy.{o}" for o in trainer),
        "rft.tokens_per_batch=2048", *(f"rft.{o}" for o in trainer),
    ]


def test_a_registered_recipe_runs_over_the_stages_and_resumes(rft_twice, overrides, tmp_path):
    config = load_config(EvolveConfig, None, [*overrides, "baselines=[rft_twice]", f"runs_dir={tmp_path}", "name=run"])
    table = run_evolve(config, log=lambda message: None)
    stages = {s["name"]: s for s in json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]}
    # after Q-Evolve's own iteration 1 (outcome labels: no critic), from its starting policy and buffer
    assert list(stages) == ["bc", "bc/eval_seen", "iter_1/rollouts", "iter_1/buffer", "iter_1/label", "iter_1/policy",
                            "iter_1/eval_seen", "iter_1/rft_twice/first", "iter_1/rft_twice/policy",
                            "iter_1/rft_twice/eval_seen"]
    assert stages["iter_1/rft_twice/first"]["inputs"] == {"buffer": "iter_1/buffer/buffer.parquet", "start": "bc/final"}
    assert stages["iter_1/rft_twice/policy"]["inputs"]["start"] == "iter_1/rft_twice/first/final"
    assert stages["iter_1/rft_twice/eval_seen"]["inputs"]["policy"] == "iter_1/rft_twice/policy/final"
    assert [row["policy"] for row in table] == ["BC", "Q-Evolve iter 1", "rft_twice (iter 1)"]
    # the saved policy says how the run evaluates it (as the recipe's stages do)
    info = json.loads((tmp_path / "run" / "iter_1/rft_twice/policy/final/qevolve_policy.json").read_text())
    assert info["evaluation"]["stages"] == ["iter_1/rft_twice/eval_seen"]
    # a resumed run finds every stage recorded and runs none
    ran: list[str] = []
    assert run_evolve(config, resume=True, log=ran.append) == table
    assert [message for message in ran if message.startswith("[")] == [
        f"[{name}] done earlier, skipped (resume)" for name in stages]
    assert json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"] == list(stages.values())


def test_baselines_name_registered_recipes_in_one_line(rft_twice):
    with pytest.raises(ConfigError, match=r"baselines.*unknown recipe 'rft_thrice' \(registered recipes: rft, eto, "
                       r"rerank, grpo, ppo, rft_twice\)") as error:
        load_config(EvolveConfig, None, ["baselines=[rft, rft_thrice]"])
    assert "\n" not in str(error.value)
    assert load_config(EvolveConfig, None, ["baselines=[rft_twice]"]).baselines == ["rft_twice"]


def test_a_name_is_registered_once_and_names_a_folder(rft_twice):
    with pytest.raises(ValueError, match="recipe 'rft_twice' is registered already"):
        register_recipe("rft_twice")(lambda run, start: None)
    with pytest.raises(ValueError, match="without '/'"):
        register_recipe("iter/rft")
    with pytest.raises(ValueError, match="a stage of every iteration has this name"):
        register_recipe("critic")


def test_a_recipe_that_reads_the_critic_has_it_trained():
    no_critic = ["label.estimator=outcome"]
    assert not main_critic_read(load_config(EvolveConfig, None, no_critic))
    assert main_critic_read(load_config(EvolveConfig, None, [*no_critic, "baselines=[rerank]"]))

    @register_recipe("critic_reader", reads_critic=True)
    def critic_reader(run: Run, start: Start) -> None:
        """Reads the iteration's critic."""

    try:
        assert main_critic_read(load_config(EvolveConfig, None, [*no_critic, "baselines=[critic_reader]"]))
    finally:
        del RECIPES["critic_reader"]


def test_show_config_lists_the_recipes_with_their_descriptions(rft_twice):
    result = CliRunner().invoke(app, ["evolve", "--show-config"])
    assert result.exit_code == 0, result.output
    for name in ("rft", "eto", "rerank", "grpo", "ppo"):
        assert f"\n#   {name}: {RECIPES[name].description}\n" in result.output
    assert "\n#   rft_twice: RFT, then RFT again from its policy.\n" in result.output


RECIPE_MODULE = '''
from qevolve.evolve.recipes import Run, Start, evaluate, register_recipe
from qevolve.evolve.stages import rft_stage


@register_recipe("rft_of_mine")
def rft_of_mine(run: Run, start: Start) -> None:
    """RFT from a module of the user's."""
    prefix = f"{start.iteration}/rft_of_mine"
    trained = run.stage(f"{prefix}/policy", rft_stage, {"buffer": start.buffer, "start": start.policy})
    evaluate(run, prefix, run.path(trained.outputs["policy"]))
'''


@pytest.fixture
def recipe_module(tmp_path, monkeypatch):
    """A module ``my_recipes`` (in a folder put on sys.path) whose import registers the recipe ``rft_of_mine``."""
    import sys

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "my_recipes.py").write_text(RECIPE_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    RECIPES.pop("rft_of_mine", None)
    sys.modules.pop("my_recipes", None)


def test_a_recipe_of_ones_own_module_is_named_by_its_spec(recipe_module, overrides, tmp_path):
    """``baselines: [my_recipes:rft_of_mine]`` imports the module, which registers the recipe: the run's stages
    are ``iter_1/rft_of_mine/...`` and the spec is what the manifest records, so a resume imports it again."""
    assert "rft_of_mine" not in RECIPES
    config = load_config(EvolveConfig, None, [*overrides, "baselines=[my_recipes:rft_of_mine]",
                                              f"runs_dir={tmp_path}", "name=run"])
    assert config.baselines == ["my_recipes:rft_of_mine"] and "rft_of_mine" in RECIPES
    table = run_evolve(config, log=lambda message: None)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert [s["name"] for s in manifest["stages"] if "rft_of_mine" in s["name"]] == [
        "iter_1/rft_of_mine/policy", "iter_1/rft_of_mine/eval_seen"]
    assert manifest["config"]["baselines"] == ["my_recipes:rft_of_mine"]
    assert [row["policy"] for row in table] == ["BC", "Q-Evolve iter 1", "rft_of_mine (iter 1)"]


def test_the_command_line_imports_the_module_of_a_recipe_spec(recipe_module, tmp_path):
    """`qevolve evolve` in a process of its own, with the module's folder on PYTHONPATH: the spec loads (and an
    unknown module or name is a one-line error naming the entry)."""
    import os
    import subprocess
    import sys

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(recipe_module), src])}

    def evolve(*overrides: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "qevolve.cli", "evolve", "--show-config", *overrides],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)

    shown = evolve("baselines=[rft, my_recipes:rft_of_mine]")
    assert shown.returncode == 0, shown.stderr
    assert "my_recipes:rft_of_mine" in shown.stdout
    for entry, message in (("not_a_module:rft_of_mine", "cannot import module 'not_a_module'"),
                           ("my_recipes:rft_of_yours", "module 'my_recipes' registers no recipe 'rft_of_yours'")):
        failed = evolve(f"baselines=[{entry}]")
        assert failed.returncode != 0
        lines = [line for line in failed.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and f"recipe '{entry}'" in lines[0] and message in lines[0], failed.stderr


def test_a_finished_training_stage_leaves_its_final_weights_and_by_default_no_checkpoints(overrides, tmp_path):
    """In-stage checkpoints only serve to resume an interrupted stage: once it is recorded they go, unless
    keep_finished_checkpoints; the manifest's digests (taken before) are the same either way."""
    runs = {}
    for keep in (False, True):
        config = load_config(EvolveConfig, None, [*overrides, "bc.save_every=1", "policy.save_every=1",
                                                  f"keep_finished_checkpoints={str(keep).lower()}",
                                                  f"runs_dir={tmp_path / str(keep)}", "name=run"])
        run_evolve(config, log=lambda message: None)
        runs[keep] = tmp_path / str(keep) / "run"
    for stage in ("bc", "iter_1/policy"):
        assert list((runs[False] / stage / "final").glob("*.safetensors"))
        assert not (runs[False] / stage / "checkpoints").exists()
        assert sorted(p.name for p in (runs[True] / stage / "checkpoints").iterdir()) == ["step-000001"]
    digests = [{s["name"]: s["digests"] for s in json.loads((run / "manifest.json").read_text())["stages"]}
               for run in runs.values()]
    assert digests[0] == digests[1] and any(path.startswith("checkpoints/step-000001/") for path in digests[0]["bc"])
