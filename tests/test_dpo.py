"""The ETO-style DPO baseline: pairs from the same task only, the loss against a plain formula, training, its
config (and the configs written when DPO was an objective of the policy stage), ``qevolve dpo``."""

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from qevolve.buffer.store import Episode, write_episodes
from qevolve.cli import app
from qevolve.config import ConfigError, load_config
from qevolve.models.loading import LoraSettings, ModelConfig
from qevolve.policy.bppo import PolicyStageConfig
from qevolve.policy.dpo import DPOConfig, build_preference_pairs, dpo_loss, run_dpo
from qevolve.training.trainer import resume_fingerprint, upgraded_fingerprint

from test_bppo import PROMPT, mean_logprob

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

#: the eto section of a run's manifest from when DPO was an objective of the policy stage (a whole
#: policy-stage config; the fields the loop decides left out), with beta 0.3, 2 pairs per task, 5 steps
OLD_ETO_SECTION = {
    "optim": {"lr": 5e-05, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-08, "max_grad_norm": 1.0,
              "warmup_steps": None, "warmup_ratio": 0.05, "min_lr_ratio": 0.1, "implementation": "default"},
    "epochs": 1.0, "max_steps": 5, "tokens_per_batch": 4096, "grad_accum_steps": 4, "batching": "pack",
    "save_every": 50, "keep_checkpoints": 2, "log_every": 1, "tensorboard": True, "save_final": True,
    "stop_after_steps": None, "distributed": {"backend": "auto", "timeout_s": 1800.0},
    "objective": {"name": "dpo", "eps_low": 0.8, "eps_high": 0.4, "kl_coef": 0.02, "kl_estimator": "k3",
                  "awr_beta": 1.0, "awr_max_weight": 20.0, "dpo_beta": 0.3, "dpo_sft_coef": 0.0,
                  "dpo_min_score_gap": 1e-06, "dpo_max_pairs_per_task": 2},
    "standardize_advantages": "buffer", "standardize_min_std": 1e-06, "advantage_floor": None,
    "only_sources": None, "include_failed": False, "target_kl": None}


def _episode(eid, task, score, source="self"):
    return Episode(eid, task, "alfworld", "train", source, won=score >= 1.0, score=score)


def test_pairs_only_within_a_task_best_against_each_worse():
    episodes = [_episode("a-lost", "A", 0.0), _episode("a-exp", "A", 1.0, "expert"), _episode("a-won", "A", 1.0),
                _episode("b-lost", "B", 0.0), _episode("c-won", "C", 1.0), _episode("d-half", "D", 0.5),
                _episode("d-zero", "D", 0.0), _episode("d-same", "D", 0.5)]
    pairs = build_preference_pairs(episodes)
    names = [(episodes[w].episode_id, episodes[l].episode_id) for w, l in pairs]
    # A: the expert wins the tie with the self success and is paired with the failure only;
    # B (no success) and C (no failure) give no pair; D: graded scores, ties give no pair.
    assert names == [("a-exp", "a-lost"), ("d-half", "d-zero")]
    for w, l in pairs:
        assert episodes[w].task_id == episodes[l].task_id and episodes[w].score > episodes[l].score
    assert build_preference_pairs(episodes, max_pairs_per_task=1) == pairs
    assert build_preference_pairs(episodes, min_score_gap=0.6) == pairs[:1]


def test_dpo_loss_matches_the_plain_formula():
    pc, pr, rc, rr = torch.tensor([-10.0, -3.0]), torch.tensor([-12.0, -2.0]), torch.tensor([-11.0, -3.5]), \
        torch.tensor([-11.5, -2.5])
    beta = 0.3
    losses, margins = dpo_loss(pc, pr, rc, rr, beta)
    for k in range(2):
        m = beta * ((pc[k] - rc[k]) - (pr[k] - rr[k]))
        assert float(margins[k]) == pytest.approx(float(m))
        assert float(losses[k]) == pytest.approx(-math.log(1.0 / (1.0 + math.exp(-float(m)))), rel=1e-6)
    # at the reference the loss is log 2
    same, _ = dpo_loss(pc, pr, pc, pr, beta)
    assert torch.allclose(same, torch.full((2,), math.log(2.0)))


def test_dpo_raises_the_chosen_trajectory_over_the_rejected(alfworld_experts, tiny_model_dir, tmp_path):
    chosen = copy.deepcopy(alfworld_experts[0])
    rejected = copy.deepcopy(alfworld_experts[1])
    rejected.task_id, rejected.won, rejected.score, rejected.source = chosen.task_id, False, 0.0, "self"
    unrelated = copy.deepcopy(alfworld_experts[2])
    unrelated.won, unrelated.score = False, 0.0  # a failure of another task: no partner, never trained on
    write_episodes(tmp_path / "buffer.parquet", [chosen, rejected, unrelated])
    config = DPOConfig(
        buffer_path=str(tmp_path / "buffer.parquet"), prompt=PROMPT,
        model=ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu",
                          lora=LoraSettings(enabled=False)),
        beta=0.5, max_steps=6, grad_accum_steps=1, tokens_per_batch=16384, output_dir=str(tmp_path / "out"),
        progress=False, tensorboard=False)
    config.optim.lr = 3e-3
    config.optim.warmup_ratio = 0.0
    before = mean_logprob(tiny_model_dir, [chosen, rejected])
    result = run_dpo(config, log=lambda m: None)
    assert result.steps == 6 and result.final_dir is not None
    after = mean_logprob(result.final_dir, [chosen, rejected])
    assert (after[0] - before[0]) - (after[1] - before[1]) > 0.05, (before, after)
    assert result.stats[0]["dpo_loss"] == pytest.approx(math.log(2.0), abs=1e-4)  # starts at the reference
    assert result.stats[-1]["reward_margin"] > 0


def test_dpo_without_pairs_is_a_clear_error(alfworld_experts, tiny_model_dir, tmp_path):
    write_episodes(tmp_path / "buffer.parquet", alfworld_experts[:2])  # all won, different tasks
    config = DPOConfig(
        buffer_path=str(tmp_path / "buffer.parquet"), prompt=PROMPT,
        model=ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu"),
        output_dir=str(tmp_path / "out"), progress=False, tensorboard=False)
    with pytest.raises(ValueError, match="no \\(better, worse\\) episode pairs of the same task"):
        run_dpo(config, log=lambda m: None)


def test_dpo_refuses_a_multi_process_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets; DPO trains in one process only
    config = DPOConfig(buffer_path=str(tmp_path / "buffer.parquet"), output_dir=str(tmp_path / "out"),
                       progress=False, tensorboard=False)
    with pytest.raises(ValueError, match=r"^policy/dpo: a launcher started 2 processes \(WORLD_SIZE=2\), but DPO "
                                         r"trains in one process only"):
        run_dpo(config, log=lambda m: None)
    assert not (tmp_path / "out").exists()


def _one_line_error(overrides, path=None):
    with pytest.raises(ConfigError) as caught:
        load_config(DPOConfig, path, overrides)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_the_dpo_config_refuses_bad_values_and_bppo_settings_naming_the_field():
    assert "field 'beta'" in _one_line_error(["beta=0"])
    assert "field 'max_pairs_per_task'" in _one_line_error(["max_pairs_per_task=0"])
    assert "field 'min_score_gap'" in _one_line_error(["min_score_gap=-1"])
    assert "unknown field 'kl_coef'" in _one_line_error(["kl_coef=0.1"])  # BPPO's, never DPO's
    assert "unknown field 'bta' (did you mean 'beta'?)" in _one_line_error(["bta=0.2"])
    # keys of the policy stage that DPO never read: refused unless at the value old configs recorded by default
    assert "target_kl=0.05: a BPPO/AWR setting that DPO never used" in _one_line_error(["target_kl=0.05"])
    assert "objective.kl_coef=0.05: a BPPO/AWR setting that DPO never used" in \
        _one_line_error(["objective.name=dpo", "objective.kl_coef=0.05"])
    assert "objective.name 'bppo': this is DPO's config" in _one_line_error(["objective.name=bppo"])
    assert "both set DPO's beta; keep beta only" in _one_line_error(["objective.dpo_beta=0.2", "beta=0.3"])
    # the policy stage no longer runs DPO: one line that names the command that does
    with pytest.raises(ConfigError, match=r"name 'dpo': DPO has a config and a command of its own: `qevolve dpo"):
        load_config(PolicyStageConfig, None, ["objective.name=dpo"])


def test_a_config_from_when_dpo_was_a_policy_objective_is_the_same_dpo_config(tmp_path):
    new = DPOConfig(beta=0.3, max_pairs_per_task=2, max_steps=5)
    assert DPOConfig.model_validate(OLD_ETO_SECTION) == new
    # a checkpoint made then records that config's fingerprint: it resumes under the new config
    assert upgraded_fingerprint(DPOConfig, OLD_ETO_SECTION) == resume_fingerprint(new)
    assert upgraded_fingerprint(DPOConfig, {**OLD_ETO_SECTION, "max_steps": 6}) != resume_fingerprint(new)
    # an old policy-stage YAML file for DPO loads as it was written
    old_yaml = tmp_path / "old.yaml"
    old_yaml.write_text(yaml.safe_dump({"objective": {"name": "dpo", "dpo_beta": 0.3, "dpo_max_pairs_per_task": 2},
                                        "max_steps": 5, "standardize_advantages": "buffer"}))
    assert load_config(DPOConfig, old_yaml) == new
    # a BPPO objective recorded DPO's settings at their defaults (every old manifest and checkpoint): dropped
    recorded = {"objective": {"name": "bppo", "dpo_beta": 0.1, "dpo_sft_coef": 0.0, "dpo_min_score_gap": 1e-6,
                              "dpo_max_pairs_per_task": None}}
    assert PolicyStageConfig.model_validate(recorded) == PolicyStageConfig()
    with pytest.raises(ValueError, match="dpo_beta=0.5: a DPO setting, which the bppo objective never used"):
        PolicyStageConfig.model_validate({"objective": {"name": "bppo", "dpo_beta": 0.5}})


def test_a_checkpoint_made_when_dpo_was_a_policy_objective_resumes_under_the_dpo_config(tmp_path):
    from qevolve.atomic_io import atomic_torch_save
    from qevolve.training.trainer import Trainer

    atomic_torch_save({"fingerprint": OLD_ETO_SECTION, "step": 3}, tmp_path / "checkpoints" / "step-3" /
                      "trainer_state.pt")
    same = DPOConfig(beta=0.3, max_pairs_per_task=2, max_steps=5, output_dir=str(tmp_path))
    assert Trainer(same).start_step == 3
    with pytest.raises(ValueError, match="its checkpoint was made with a different 'beta'"):
        Trainer(same.model_copy(update={"beta": 0.5}))


def test_the_shipped_dpo_config_is_the_defaults():
    assert load_config(DPOConfig, CONFIGS / "dpo.yaml") == DPOConfig()


def test_qevolve_dpo_trains_a_tiny_policy(alfworld_experts, tiny_model_dir, tmp_path):
    chosen = copy.deepcopy(alfworld_experts[0])
    rejected = copy.deepcopy(alfworld_experts[1])
    rejected.task_id, rejected.won, rejected.score, rejected.source = chosen.task_id, False, 0.0, "self"
    write_episodes(tmp_path / "buffer.parquet", [chosen, rejected])
    settings = ["model.precision=fp32", "model.device=cpu", "model.lora.enabled=false",
                "prompt.max_prompt_tokens=2048", "prompt.reserve_action_tokens=16", "max_steps=2",
                "grad_accum_steps=1", "tokens_per_batch=16384", "progress=false", "tensorboard=false"]
    runner = CliRunner()
    missing = runner.invoke(app, ["dpo", "--init", str(tiny_model_dir)])
    assert missing.exit_code == 2 and "--buffer: required" in missing.output
    result = runner.invoke(app, ["dpo", "--buffer", str(tmp_path / "buffer.parquet"), "--init", str(tiny_model_dir),
                                 "--config", str(CONFIGS / "dpo.yaml"), f"output_dir={tmp_path / 'out'}", "beta=0.5",
                                 *settings])
    assert result.exit_code == 0, result.output
    assert "policy (dpo, beta 0.5): 1 pairs over 2 episodes of 1 tasks; 2 steps" in result.output
    summary = json.loads((tmp_path / "out" / "policy_summary.json").read_text())
    assert summary["steps"] == 2 and summary["pairs"] == 1 and summary["final_dir"] == "final"
    assert (tmp_path / "out" / "final").is_dir()
