"""The BPPO trainer on a labelled buffer of real ALFWorld turns, with a tiny policy."""

import copy

import pytest
import torch

from qevolve.buffer.store import write_episodes
from qevolve.policy.bppo import PolicyStageConfig, run_policy_update, sequence_logprobs
from qevolve.policy.model import LoraSettings, ModelConfig, load_policy
from qevolve.policy.objectives import ObjectiveConfig
from qevolve.policy.bc import prepare_sequences
from qevolve.policy.prompts import PromptBuilder, PromptConfig

PROMPT = PromptConfig(max_prompt_tokens=2048, reserve_action_tokens=16)


def labelled_buffer(experts, path, sign=1.0):
    """Two expert episodes: every turn of the first gets A = sign, every turn of the second A = 0."""
    target, other = copy.deepcopy(experts[0]), copy.deepcopy(experts[1])
    for episode, advantage in ((target, sign), (other, 0.0)):
        for turn in episode.turns:
            turn.advantage = advantage
    write_episodes(path, [target, other])
    return target, other


def mean_logprob(model_dir, episodes):
    policy = load_policy(ModelConfig(name_or_path=str(model_dir), precision="fp32", device="cpu"), trainable=False)
    builder = PromptBuilder.for_environment(policy.tokenizer, PROMPT, "alfworld")
    sequences = prepare_sequences(episodes, builder)
    logps = sequence_logprobs(policy, sequences, 4096, "pack")
    return [float(lp.mean()) for lp in logps]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_positive_advantages_rise_and_negative_fall(alfworld_experts, tiny_model_dir, tmp_path, sign):
    target, other = labelled_buffer(alfworld_experts, tmp_path / "labelled.parquet", sign)
    config = PolicyStageConfig(
        buffer_path=str(tmp_path / "labelled.parquet"), prompt=PROMPT,
        model=ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu",
                          lora=LoraSettings(enabled=False)),
        objective=ObjectiveConfig(name="bppo", kl_coef=0.0), standardize_advantages="none",
        max_steps=6, grad_accum_steps=1, tokens_per_batch=8192, output_dir=str(tmp_path / "out"),
        progress=False, tensorboard=False)
    config.optim.lr = 3e-3
    config.optim.warmup_ratio = 0.0
    before = mean_logprob(tiny_model_dir, [target])[0]
    result = run_policy_update(config, log=lambda m: None)
    assert result.steps == 6 and result.final_dir is not None
    after = mean_logprob(result.final_dir, [target])[0]
    assert (after - before) * sign > 0.05, (before, after)
    first = result.stats[0]
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # pi_old is the starting policy
    assert {"clip_frac_low", "clip_frac_high", "approx_kl_old", "kl_ref"} <= set(first)


def test_resume_matches_an_uninterrupted_run(alfworld_experts, tiny_model_dir, tmp_path):
    labelled_buffer(alfworld_experts, tmp_path / "labelled.parquet")

    def config(out, **extra):
        cfg = PolicyStageConfig(
            buffer_path=str(tmp_path / "labelled.parquet"), prompt=PROMPT,
            model=ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu"),
            max_steps=4, grad_accum_steps=1, tokens_per_batch=1024, save_every=1, output_dir=str(out),
            progress=False, tensorboard=False, **extra)
        return cfg

    whole = run_policy_update(config(tmp_path / "a"), log=lambda m: None)
    first = run_policy_update(config(tmp_path / "b", stop_after_steps=2), log=lambda m: None)
    assert first.interrupted and first.steps == 2
    rest = run_policy_update(config(tmp_path / "b"), log=lambda m: None)
    assert rest.steps == 4
    from safetensors.torch import load_file
    a = load_file(str(whole.final_dir / "adapter_model.safetensors"))
    b = load_file(str(rest.final_dir / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unlabelled_buffer_is_a_clear_error(alfworld_experts, tiny_model_dir, tmp_path):
    write_episodes(tmp_path / "raw.parquet", alfworld_experts[:1])
    config = PolicyStageConfig(buffer_path=str(tmp_path / "raw.parquet"), prompt=PROMPT,
                               model=ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu"),
                               output_dir=str(tmp_path / "out"), progress=False, tensorboard=False)
    with pytest.raises(ValueError, match="has no advantage; label the buffer first"):
        run_policy_update(config, log=lambda m: None)
