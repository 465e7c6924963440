from typing import Literal

import pytest
from pydantic import Field

from qevolve.config import ConfigError, StageConfig, apply_overrides, describe_config, load_config


class Inner(StageConfig):
    lr: float = Field(1e-4, description="learning rate")


class Demo(StageConfig):
    epochs: int = Field(2, description="passes over the data")
    mode: Literal["frozen", "lora"] = Field("frozen", description="backbone mode")
    optim: Inner = Field(default_factory=Inner, description="optimiser")


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 3\noptim:\n  lr: 0.01\n")
    cfg = load_config(Demo, path, ["optim.lr=0.5", "mode=lora"])
    assert cfg.epochs == 3 and cfg.optim.lr == 0.5 and cfg.mode == "lora"


def test_unknown_and_wrong_type_name_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochz: 3\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown field 'epochz'"):
        load_config(Demo, path)
    with pytest.raises(ConfigError, match=r"field 'optim.lr': .*got \"fast\""):
        load_config(Demo, None, ["optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"field 'mode'"):
        load_config(Demo, None, ["mode=full"])
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides({}, ["epochs"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Demo, tmp_path / "missing.yaml")


def test_describe_lists_nested_fields():
    rows = {name: (kind, default, doc) for name, kind, default, doc in describe_config(Demo)}
    assert rows["optim.lr"] == ("float", "0.0001", "learning rate")
    assert rows["epochs"][2] == "passes over the data"


def test_unknown_fields_suggest_the_closest_names(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr_: 0.1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: unknown field 'optim.lr_' \(did you mean 'optim.lr'\?\)"):
        load_config(Demo, path)
    with pytest.raises(ConfigError, match=r"override 'epoch=3': unknown field 'epoch' \(did you mean 'epochs'\?\)"):
        load_config(Demo, None, ["epoch=3"])
    with pytest.raises(ConfigError, match=r"unknown field 'zzz'$"):  # nothing close: no guess
        load_config(Demo, None, ["zzz=3"])


def test_evolve_sections_suggest_through_variants():
    from qevolve.evolve.loop import EvolveConfig

    with pytest.raises(ConfigError, match=r"unknown field 'eval.agent.max_new_token' \(did you mean "
                                          r"'eval.agent.max_new_tokens'\?\)"):
        load_config(EvolveConfig, None, ["eval.agent.max_new_token=3"])
    with pytest.raises(ConfigError, match=r"unknown field 'variants.a.critc' \(did you mean 'variants.a.critic'"):
        load_config(EvolveConfig, None, ["variants.a.critc={}"])


def test_fields_the_loop_decides_are_refused_naming_what_decides_them(tmp_path):
    from qevolve.evolve.loop import EvolveConfig

    path = tmp_path / "x.yaml"
    path.write_text("bc:\n  model:\n    lora: {enabled: true}\n  epochs: 2\n")
    with pytest.raises(ConfigError) as err:
        load_config(EvolveConfig, path)
    assert str(err.value) == (f"{path}: bc.model.lora.enabled is decided by model.lora.enabled (the loop sets "
                              "bc.model from model); set model.lora.enabled instead")
    with pytest.raises(ConfigError, match=r"^override 'policy.seed=3': policy.seed is decided by seed \("):
        load_config(EvolveConfig, None, ["policy.seed=3"])
    with pytest.raises(ConfigError, match=r"^override 'rft.data.train_path=b': rft.data.train_path is not a "
                                          r"setting \(RFT trains on iteration 1's buffer\); remove it$"):
        load_config(EvolveConfig, None, ["rft.data.train_path=b"])
    with pytest.raises(ConfigError, match=r"policy.model.name_or_path is not a setting"):
        load_config(EvolveConfig, None, ["policy.model.name_or_path=x"])
    with pytest.raises(ConfigError, match=r"variants.awr.policy.prompt.max_prompt_tokens is decided by "
                                          r"prompt.max_prompt_tokens"):
        load_config(EvolveConfig, None, ["variants.awr.policy.prompt.max_prompt_tokens=5"])
    for item in ("eval.agent.seed=1", "bc.data.env=webshop", "eto.reference=x", "critic.seed=1"):
        with pytest.raises(ConfigError, match="decided by|not a setting"):
            load_config(EvolveConfig, None, [item])
    # the fields of the same sections that the loop reads as given stay settable
    config = load_config(EvolveConfig, None, [
        "bc.data.train_path=t.parquet", "bc.data.num_demonstrations=5", "bc.data.seed=3", "rft.epochs=2",
        "rft.data.include_failed=true", "critic.init=c", "eval.agent.max_new_tokens=96", "policy.epochs=2",
        "variants.awr.policy.objective.name=awr", "model.lora.enabled=false"])
    assert (config.bc.data.num_demonstrations, config.rft.epochs, config.critic.init) == (5, 2.0, "c")


def test_shipped_configs_render_within_100_columns_and_load_back():
    from pathlib import Path

    import yaml

    from qevolve.config import render_config
    from qevolve.evolve.loop import EvolveConfig

    root = Path(__file__).resolve().parents[1] / "configs"
    files = [f for f in sorted(root.glob("**/*.yaml")) if f.parent.name in ("configs", "cpu", "gpu", "ablations")
             and f.stem not in ("bc", "critic", "dpo", "label")]
    assert len(files) == 28
    for path in files:
        config = load_config(EvolveConfig, path)
        text = render_config(EvolveConfig, config, ["a header that is long enough to need wrapping " * 4])
        assert max(len(line) for line in text.splitlines()) <= 100, path
        assert EvolveConfig.model_validate(yaml.safe_load(text)) == config, path
    assert max(len(line) for line in render_config(EvolveConfig, None).splitlines()) <= 100


def test_a_manifest_records_no_field_the_loop_decides_and_old_ones_still_resume(tmp_path):
    """A full fine-tuning run does not record bc.model.lora.enabled: true (the loop trains with model's)."""
    from qevolve.evolve.loop import EvolveConfig, recorded_config, upgrade_recorded
    from qevolve.evolve.run_dir import RunDirectory, RunError

    config = load_config(EvolveConfig, None, ["model.lora.enabled=false"])
    assert config.bc.model.lora.enabled is True  # the unused section default
    recorded = recorded_config(config)
    assert "model" not in recorded["bc"] and "env" not in recorded["bc"]["data"] and "seed" not in recorded["policy"]
    assert recorded["model"]["lora"]["enabled"] is False and "num_demonstrations" in recorded["bc"]["data"]
    assert "seed" not in recorded["eval"]["agent"] and "max_new_tokens" in recorded["eval"]["agent"]
    # a run written before: its manifest holds every field; it resumes with today's config
    RunDirectory(tmp_path / "old", config.model_dump(mode="json"), seed=0).close()
    RunDirectory(tmp_path / "old", recorded, seed=0, resume=True, upgrade=upgrade_recorded).close()
    changed = recorded_config(load_config(EvolveConfig, None, ["model.lora.enabled=true"]))
    with pytest.raises(RunError, match="model.lora.enabled=false, this config has model.lora.enabled=true"):
        RunDirectory(tmp_path / "old", changed, seed=0, resume=True, upgrade=upgrade_recorded)


#: critic.retrospective.penalties as every run recorded it while the built-in environments' penalties
#: were that field's default (today each environment's class declares its own)
RECORDED_PENALTIES = {"alfworld": {"format_error": -0.3, "invalid_action": -0.2, "repeat": -0.1},
                      "sciworld": {"format_error": -0.3, "invalid_action": -0.2, "repeat": -0.1},
                      "webshop": {"format_error": -0.3, "invalid_action": 0.0, "repeat": 0.0}}


def test_a_manifest_with_the_old_penalties_table_resumes_with_the_same_penalties(tmp_path):
    from qevolve.critic.retrospective import AuxPenalties, penalties_for
    from qevolve.evolve.loop import EvolveConfig, recorded_config, upgrade_recorded
    from qevolve.evolve.run_dir import RunDirectory, RunError

    config = load_config(EvolveConfig, None, ["env=webshop"])
    assert config.critic.retrospective.penalties == {}
    for env, numbers in RECORDED_PENALTIES.items():  # the labels of a resumed stage are the recorded ones
        assert penalties_for(env, config.critic.retrospective) == AuxPenalties(**numbers)
    old = recorded_config(config)
    old["critic"]["retrospective"]["penalties"] = RECORDED_PENALTIES
    RunDirectory(tmp_path / "old", old, seed=0).close()
    assert upgrade_recorded(old) == recorded_config(config)
    RunDirectory(tmp_path / "old", recorded_config(config), seed=0, resume=True, upgrade=upgrade_recorded).close()
    # an entry that differs from the environment's declaration is an override: a resume without it is refused
    changed = recorded_config(load_config(EvolveConfig, None, ["env=webshop",
                                                               "critic.retrospective.penalties.webshop.repeat=-0.1"]))
    assert list(changed["critic"]["retrospective"]["penalties"]) == ["webshop"]
    with pytest.raises(RunError, match="critic.retrospective.penalties"):
        RunDirectory(tmp_path / "old", changed, seed=0, resume=True, upgrade=upgrade_recorded)


def test_a_penalties_override_changes_only_the_numbers_it_gives():
    """WebShop declares -0.3/0/0; overriding its format penalty must keep its 0/0, not take the field
    defaults -0.2/-0.1 (ALFWorld's numbers)."""
    from qevolve.critic.retrospective import AuxPenalties, penalties_for
    from qevolve.evolve.loop import EvolveConfig, recorded_config

    config = load_config(EvolveConfig, None, ["env=webshop", "critic.retrospective.penalties.webshop.format_error=-0.5"])
    assert penalties_for("webshop", config.critic.retrospective) == AuxPenalties(format_error=-0.5, invalid_action=0.0,
                                                                                repeat=0.0)
    assert penalties_for("alfworld", config.critic.retrospective) == AuxPenalties(format_error=-0.3,
                                                                                 invalid_action=-0.2, repeat=-0.1)
    # recorded whole, so a resume (which validates the recorded dict again) reads the same numbers
    recorded = recorded_config(config)["critic"]["retrospective"]["penalties"]
    assert recorded == {"webshop": {"format_error": -0.5, "invalid_action": 0.0, "repeat": 0.0}}
    again = load_config(EvolveConfig, None, ["env=webshop"]).critic.retrospective.model_validate(
        {"penalties": recorded})
    assert penalties_for("webshop", again) == AuxPenalties(format_error=-0.5, invalid_action=0.0, repeat=0.0)


def test_a_partial_baseline_section_keeps_the_baselines_own_defaults():
    """rft's default budget is one epoch with 2-step accumulation: setting one other field of the section
    must not fall back to the plain stage defaults. eto is DPO's config, whose defaults are its own."""
    from qevolve.config import load_config
    from qevolve.evolve.loop import EvolveConfig
    from qevolve.policy.dpo import DPOConfig

    config = load_config(EvolveConfig, None, ["eto.max_steps=5", "rft.save_every=3"])
    assert isinstance(config.eto, DPOConfig) and config.eto.max_steps == 5 and config.eto.beta == 0.1
    assert config.eto.optim.lr == EvolveConfig().eto.optim.lr == 5e-5
    assert (config.rft.epochs, config.rft.grad_accum_steps, config.rft.save_every) == (1, 2, 3)
    with pytest.raises(ConfigError, match="eto.*objective.name 'bppo': this is DPO's config"):
        load_config(EvolveConfig, None, ["eto.objective.name=bppo"])


def test_an_eto_section_from_when_dpo_was_a_policy_objective_loads_and_resumes(tmp_path):
    """A run recorded its eto section as a whole policy-stage config with objective dpo (and every policy
    objective recorded DPO's settings at their defaults): it resumes under today's config without a change."""
    from qevolve.evolve.loop import EvolveConfig, recorded_config, upgrade_recorded
    from qevolve.evolve.run_dir import RunDirectory, RunError

    from test_dpo import OLD_ETO_SECTION

    config = load_config(EvolveConfig, None, ["baselines=[eto]", "eto.beta=0.3", "eto.max_pairs_per_task=2",
                                              "eto.max_steps=5"])
    old = recorded_config(config)
    old["eto"] = OLD_ETO_SECTION
    for section in (old["policy"], old["grpo"]["policy"], old["ppo"]["policy"]):
        section["objective"].update({"dpo_beta": 0.1, "dpo_sft_coef": 0.0, "dpo_min_score_gap": 1e-06,
                                     "dpo_max_pairs_per_task": None})
    assert upgrade_recorded(old) == recorded_config(config)
    RunDirectory(tmp_path / "old", old, seed=0).close()
    with RunDirectory(tmp_path / "old", recorded_config(config), seed=0, resume=True,
                      upgrade=upgrade_recorded) as resumed:
        assert resumed.resume_changes == []
    # the YAML of such a run loads too (configs written with objective: {name: dpo, dpo_beta: ...})
    path = tmp_path / "old.yaml"
    path.write_text("baselines: [eto]\neto:\n  objective: {name: dpo, dpo_beta: 0.3, dpo_max_pairs_per_task: 2}\n"
                    "  max_steps: 5\n")
    assert load_config(EvolveConfig, path) == config
    changed = recorded_config(load_config(EvolveConfig, None, ["baselines=[eto]", "eto.beta=0.5",
                                                               "eto.max_pairs_per_task=2", "eto.max_steps=5"]))
    with pytest.raises(RunError, match="eto.beta=0.3, this config has eto.beta=0.5"):
        RunDirectory(tmp_path / "old", changed, seed=0, resume=True, upgrade=upgrade_recorded)


def test_the_sample_efficiency_config_is_the_quick_protocol_with_k3_and_the_online_baselines_budgets():
    """configs/cpu/webshop-sample-efficiency.yaml: every setting of configs/cpu/webshop-quick.yaml, plus K = 3,
    its seeds, and GRPO and PPO at 2,400 env steps evaluated on the way at 240 and 720 (1x, 3x, 10x Q-Evolve
    K = 3's measured ~240), with rounds of 8 tasks x 4 episodes at the quick protocol's BPPO batch."""
    from pathlib import Path

    from qevolve.evolve.loop import EvolveConfig

    root = Path(__file__).resolve().parents[1] / "configs" / "cpu"
    quick = load_config(EvolveConfig, root / "webshop-quick.yaml").model_dump()
    figure = load_config(EvolveConfig, root / "webshop-sample-efficiency.yaml").model_dump()
    assert (figure["name"], figure["seeds"], figure["iterations"], figure["baselines"]) == (
        "cpu-webshop-sample-efficiency", [0, 1, 2], 3, ["rft", "grpo", "ppo"])
    for name, episodes in (("grpo", "group_size"), ("ppo", "episodes_per_task")):
        section = figure[name]
        assert (section["rounds"], section["env_steps"], section["evaluate_at_env_steps"]) == (None, 2400, [240, 720])
        assert (section[episodes], section["tasks_per_round"]) == (4, 8)
        policy = section["policy"]
        assert (policy["tokens_per_batch"], policy["grad_accum_steps"]) == (4096, 1)
        assert policy["optim"]["min_lr_ratio"] == 1.0 and policy["optim"]["warmup_steps"] == 0  # a constant lr
    for field in ("name", "seeds", "iterations", "baselines", "grpo", "ppo"):
        figure.pop(field), quick.pop(field)
    assert figure == quick
