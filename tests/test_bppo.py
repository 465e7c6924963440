"""The BPPO trainer on a labelled buffer of real ALFWorld turns, with a tiny policy."""

import copy

import pytest
import torch

from qevolve.buffer.store import write_episodes
from qevolve.config import ConfigError, load_config
from qevolve.models.loading import LoraSettings, ModelConfig, load_policy
from qevolve.policy import bppo
from qevolve.policy.bc import prepare_sequences
from qevolve.policy.bppo import PolicyStageConfig, _standardize, run_policy_update
from qevolve.policy.objectives import ObjectiveConfig
from qevolve.prompting import PromptBuilder, PromptConfig
from qevolve.training.forward import sequence_logprobs

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


def test_standardize_is_float64_and_only_centres_when_all_equal():
    # all-equal advantages carry no preference: centred to 0, never scaled up to +-1 (the old code gave +0.80)
    flat = _standardize(torch.full((7,), -0.8))
    assert flat.dtype == torch.float64 and flat.abs().max() < 1e-12
    out = _standardize(torch.tensor([-0.5, -0.4, -0.6], dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64) * (1.5 ** 0.5))
    assert _standardize(torch.tensor([0.3])).tolist() == [0.0]


def test_batch_mode_is_refused_with_the_field_named():
    with pytest.raises(ConfigError, match="field 'standardize_advantages'.*removed.*buffer \\(default\\), step, buffer_scale or none"):
        load_config(PolicyStageConfig, None, ["standardize_advantages=batch"])
    assert PolicyStageConfig().standardize_advantages == "buffer"


def _recorded_advantages(monkeypatch, alfworld_experts, tiny_model_dir, tmp_path, mode, per_turn, accum=None,
                         **fields):
    """One BPPO step on two episodes with the given per-turn advantages, one sequence per micro-batch.

    Returns the sequences and, for each micro-batch of the step, its sequence index and the token
    advantages the objective saw. ``accum`` micro-batches per step (default: all of them)."""
    from qevolve.training.trainer import Trainer

    episodes = [copy.deepcopy(ep) for ep in alfworld_experts[:2]]
    for episode, values in zip(episodes, per_turn):
        for turn, value in zip(episode.turns, values(episode.num_turns)):
            turn.advantage = value
    write_episodes(tmp_path / "labelled.parquet", episodes)
    policy = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu"),
                         trainable=False)
    builder = PromptBuilder.for_environment(policy.tokenizer, PROMPT, "alfworld")
    sequences = prepare_sequences(episodes, builder, policy.model.config.max_position_embeddings)
    seen, groups = [], []
    original_objective, original_groups = bppo.compute_objective, Trainer.step_groups

    def objective_spy(config, logp, old, ref, adv, mask):
        seen.append(adv.detach().double().cpu())
        return original_objective(config, logp, old, ref, adv, mask)

    def groups_spy(self, step):
        out = original_groups(self, step)
        groups.extend(out)
        return out

    monkeypatch.setattr(bppo, "compute_objective", objective_spy)
    monkeypatch.setattr(Trainer, "step_groups", groups_spy)
    config = PolicyStageConfig(
        buffer_path=str(tmp_path / "labelled.parquet"), prompt=PROMPT,
        model=ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu",
                          lora=LoraSettings(enabled=False)),
        objective=ObjectiveConfig(name="bppo", kl_coef=0.0), standardize_advantages=mode,
        max_steps=1, grad_accum_steps=accum or len(sequences), tokens_per_batch=16, batching="bucket",
        output_dir=str(tmp_path / f"out-{mode}"), progress=False, tensorboard=False, save_final=False, **fields)
    run_policy_update(config, log=lambda m: None)
    assert all(len(g) == 1 for g in groups) and len(groups) == len(seen)  # one sequence per micro-batch
    return sequences, [(g[0], adv) for g, adv in zip(groups, seen)], episodes


def _success(n):
    return [0.5 + 0.1 * (t % 3) for t in range(n)]


def _failure(n):
    return [-0.5 + 0.1 * ((t % 3) - 1) for t in range(n)]  # -0.6, -0.5, -0.4, ...


def _turn_values(sequence, episodes):
    values = (_success, _failure)[sequence.episode](episodes[sequence.episode].num_turns)
    return torch.tensor([values[t] for t in sequence.turns], dtype=torch.float64)


def _tokens(sequence, per_turn):
    return torch.repeat_interleave(per_turn, torch.tensor([end - start for start, end in sequence.spans]))


@pytest.mark.parametrize("mode", ["buffer", "step"])
def test_a_lone_failure_stays_negative_and_turns_weigh_equally(monkeypatch, alfworld_experts, tiny_model_dir,
                                                                  tmp_path, mode):
    """One success (A > 0 on every turn) and one failure (A < 0), each micro-batch one sequence.

    Per micro-batch standardisation turned the failure's [-0.5, -0.4, -0.6, ...] into values of
    both signs (pushing some failed actions up). Over the buffer (or a step holding every
    micro-batch) each failed turn stays negative, and every turn counts once, whatever its length.
    """
    sequences, seen, episodes = _recorded_advantages(monkeypatch, alfworld_experts, tiny_model_dir, tmp_path,
                                                     mode, [_success, _failure])
    turns = torch.tensor(_success(episodes[0].num_turns) + _failure(episodes[1].num_turns), dtype=torch.float64)
    shift, scale = turns.mean(), turns.std(unbiased=False)
    assert sorted(index for index, _ in seen) == list(range(len(sequences)))
    for index, adv in seen:
        sequence = sequences[index]
        want = _tokens(sequence, (_turn_values(sequence, episodes) - shift) / scale)
        torch.testing.assert_close(adv, want.float().double())
        assert (adv < 0).all() if sequence.episode == 1 else (adv > 0).all()


def test_step_mode_standardises_over_each_steps_turns(monkeypatch, alfworld_experts, tiny_model_dir, tmp_path):
    sequences, seen, episodes = _recorded_advantages(monkeypatch, alfworld_experts, tiny_model_dir, tmp_path,
                                                     "step", [_success, _failure], accum=1)
    (index, adv), = seen  # max_steps=1, one micro-batch per step
    sequence = sequences[index]
    turns = _turn_values(sequence, episodes)
    want = _tokens(sequence, (turns - turns.mean()) / turns.std(unbiased=False))
    torch.testing.assert_close(adv, want.float().double())


def _large_success(n):
    return [0.8 + 0.1 * (t % 2) for t in range(n)]


def _small_success(n):
    return [0.02 + 0.01 * (t % 2) for t in range(n)]  # a won episode's late turns once V has risen


def test_buffer_scale_keeps_every_labelled_sign_where_buffer_centring_flips_it(monkeypatch, alfworld_experts,
                                                                              tiny_model_dir, tmp_path):
    """Two won episodes, every advantage positive; the second's are small. Centring over the buffer
    pushes the second episode's turns below zero (the WebShop collapse of docs/results.md);
    buffer_scale divides by the same standard deviation and leaves every sign as labelled."""
    per_turn = [_large_success, _small_success]
    runs = {mode: _recorded_advantages(monkeypatch, alfworld_experts, tiny_model_dir, tmp_path, mode, per_turn)
            for mode in ("buffer", "buffer_scale")}
    sequences, _, episodes = runs["buffer_scale"]
    turns = torch.tensor(_large_success(episodes[0].num_turns) + _small_success(episodes[1].num_turns),
                         dtype=torch.float64)
    scale = turns.std(unbiased=False)
    for mode, (_, seen, _) in runs.items():
        for index, adv in seen:
            sequence = sequences[index]
            labelled = torch.tensor([per_turn[sequence.episode](episodes[sequence.episode].num_turns)[t]
                                     for t in sequence.turns], dtype=torch.float64)
            shift = turns.mean() if mode == "buffer" else 0.0
            torch.testing.assert_close(adv, _tokens(sequence, (labelled - shift) / scale).float().double())
            if mode == "buffer_scale":
                assert (adv > 0).all()
            elif sequence.episode == 1:
                assert (adv < 0).all()  # the flip buffer_scale avoids


def test_advantage_floor_zero_keeps_the_positive_standardised_advantages_and_zeroes_the_rest(
        monkeypatch, alfworld_experts, tiny_model_dir, tmp_path):
    sequences, seen, episodes = _recorded_advantages(monkeypatch, alfworld_experts, tiny_model_dir, tmp_path,
                                                     "buffer", [_success, _failure], advantage_floor=0.0)
    turns = torch.tensor(_success(episodes[0].num_turns) + _failure(episodes[1].num_turns), dtype=torch.float64)
    shift, scale = turns.mean(), turns.std(unbiased=False)
    for index, adv in seen:
        sequence = sequences[index]
        standardised = _tokens(sequence, (_turn_values(sequence, episodes) - shift) / scale)
        torch.testing.assert_close(adv, standardised.clamp(min=0.0).float().double())
        assert (adv > 0).all() if sequence.episode == 0 else (adv == 0).all()


def test_target_kl_stops_before_the_step_that_passes_it_and_keeps_the_policy_before(alfworld_experts,
                                                                                      tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    labelled_buffer(alfworld_experts, tmp_path / "labelled.parquet")

    def config(out, **extra):
        cfg = PolicyStageConfig(
            buffer_path=str(tmp_path / "labelled.parquet"), prompt=PROMPT,
            model=ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu",
                              lora=LoraSettings(enabled=False)),
            objective=ObjectiveConfig(name="bppo", kl_coef=0.0), standardize_advantages="none",
            max_steps=6, grad_accum_steps=1, tokens_per_batch=8192, save_every=1, keep_checkpoints=10,
            output_dir=str(out), progress=False, tensorboard=False, **extra)
        cfg.optim.lr, cfg.optim.warmup_ratio = 3e-3, 0.0
        return cfg

    free = run_policy_update(config(tmp_path / "free"), log=lambda m: None)
    kls = [s["approx_kl_old"] for s in free.stats]
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and max(kls[1:]) > 0  # pi_old is where the stage starts
    target = 0.99 * kls[3]
    stop = next(i for i, kl in enumerate(kls) if kl > target)  # the first step whose KL passes the target
    messages = []
    guarded = run_policy_update(config(tmp_path / "guarded", target_kl=target), log=messages.append)
    assert guarded.steps == stop and not guarded.interrupted and guarded.final_dir is not None
    assert guarded.target_kl_stop == {"step": stop + 1, "approx_kl_old": pytest.approx(kls[stop])}
    assert any(f"stopped before step {stop + 1} of 6" in m for m in messages)
    summary = guarded.summary()
    assert summary["target_kl_stop_step"] == stop + 1 and summary["steps"] == stop
    # the final policy is the unguarded run's after `stop` steps: the step over the target was not applied
    want = load_file(tmp_path / "free" / "checkpoints" / f"step-{stop:06d}" / "model.safetensors")
    got = load_file(guarded.final_dir / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_target_kl_must_be_positive():
    with pytest.raises(ConfigError, match="target_kl"):
        load_config(PolicyStageConfig, None, ["target_kl=0"])
    assert PolicyStageConfig().target_kl is None  # the method as published: no guard unless asked
