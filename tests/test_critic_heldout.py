"""The critic's held-out fit (``heldout_fraction``): which trajectories, what is measured, resume, variants."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

import qevolve.critic.train as critic_train
from qevolve.critic.config import CriticConfig
from qevolve.critic.testing import synthetic_buffer, tiny_critic_config
from qevolve.critic.train import (CRITIC_FILE, METRICS_FILE, STATE_FILE, critic_samples, explained_variance,
                                  heldout_indices, load_critic, predict_values, roc_auc, train_critic)

HELDOUT = ("heldout_loss_v", "heldout_loss_q", "heldout_v_scored", "heldout_v_unscored", "heldout_v_mean",
           "heldout_explained_variance", "heldout_auc_won_vs_lost")


def _samples(episodes, **changes):
    return critic_samples(episodes, CriticConfig.model_validate(changes))


def _record_training_order(monkeypatch) -> list[list[str]]:
    """The episode ids each epoch trains on, in batch order (read where the epoch's batches are cut; a config
    with k-fold refits would add theirs: the tests that record set ``diagnostics.folds`` to 0)."""
    epochs: list[list[str]] = []
    original = critic_train.token_budget_batches

    def recording(samples, order, batch_tokens):
        batches = original(samples, order, batch_tokens)
        epochs.append([samples[i].episode_id for batch in batches for i in batch])
        return batches

    monkeypatch.setattr(critic_train, "token_budget_batches", recording)
    return epochs


def _weights(path):
    saved = torch.load(path / CRITIC_FILE, weights_only=False)
    return {f"{part}.{name}": tensor for part in ("heads", "target_q", "backbone") for name, tensor in saved[part].items()}


def _without_seconds(history):
    return [{k: v for k, v in row.items() if k != "seconds"} for row in history]


def test_the_split_is_whole_episodes_per_outcome_seeded_and_independent_of_file_order():
    episodes = synthetic_buffer(40, seed=3)
    samples = _samples(episodes)
    held = heldout_indices(samples, 0.25, seed=0)
    ids = {samples[i].episode_id for i in held}
    assert len(held) == 10 and len(ids) == 10  # a quarter of 40 trajectories, each once
    assert sum(samples[i].won for i in held) == 5  # 20 won and 20 lost: a quarter of each
    assert held == heldout_indices(samples, 0.25, seed=0)  # deterministic
    shuffled = list(episodes)
    random.Random(1).shuffle(shuffled)
    reordered = _samples(shuffled)
    assert {reordered[i].episode_id for i in heldout_indices(reordered, 0.25, seed=0)} == ids  # not by file order
    assert {samples[i].episode_id for i in heldout_indices(samples, 0.25, seed=1)} != ids  # the seed decides
    assert heldout_indices(samples, 0.0, seed=0) == []
    # a small set keeps both outcomes where each has two, and never holds out an outcome's last trajectory
    few = _samples(synthetic_buffer(5, seed=3))  # 3 won, 2 lost
    held_few = heldout_indices(few, 0.1, seed=0)
    assert sorted(few[i].won for i in held_few) == [False, True]
    one_lost = _samples([ep for ep in synthetic_buffer(6, seed=3) if ep.won] + [synthetic_buffer(2, seed=3)[1]])
    assert [one_lost[i].won for i in heldout_indices(one_lost, 0.9, seed=0)] == [True, True]  # 2 of 3 won, 0 of 1 lost


def test_roc_auc_counts_ties_as_half():
    assert roc_auc(np.array([0.9, 0.8]), np.array([0.1, 0.2])) == 1.0
    assert roc_auc(np.array([0.1]), np.array([0.9])) == 0.0
    assert roc_auc(np.array([0.5, 0.9]), np.array([0.5, 0.1])) == pytest.approx((0.5 + 1 + 1 + 1) / 4)
    assert math.isnan(roc_auc(np.array([0.5]), np.array([])))


def test_default_trains_on_every_sample_in_the_same_order_and_writes_no_heldout_keys(tiny_critic_init, tmp_path,
                                                                                     monkeypatch):
    episodes = synthetic_buffer(12, seed=5)
    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=2, diagnostics={"folds": 0})
    assert config.heldout_fraction == 0.0
    epochs = _record_training_order(monkeypatch)
    summary = train_critic(episodes, config, tmp_path / "a", progress=False)
    samples = critic_samples(episodes, config)
    assert epochs == [[samples[i].episode_id for i in critic_train._epoch_order(len(samples), config.seed, e)]
                      for e in range(2)]
    assert not any(key.startswith("heldout") for row in summary["history"] for key in row)
    assert not any(key.startswith("heldout") for key in summary) and summary["episodes"] == 12
    assert torch.load(tmp_path / "a" / STATE_FILE, weights_only=False)["heldout"] == []
    train_critic(episodes, config, tmp_path / "b", progress=False)
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_heldout_trajectories_are_not_trained_on_and_their_fit_is_measured(tiny_critic_init, tmp_path, monkeypatch):
    episodes = synthetic_buffer(32, seed=11, min_turns=2, max_turns=5)
    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=12, heldout_fraction=0.25, iql={"polyak": 0.05},
                                checkpoint_every_steps=10_000, diagnostics={"folds": 0},
                                label_value="last")  # 72 steps: the V head itself, not a mean of them all
    samples = critic_samples(episodes, config)
    held_ids = {samples[i].episode_id for i in heldout_indices(samples, 0.25, config.seed)}
    assert len(held_ids) == 8
    # the held-out trajectories' rewards say the opposite of the training ones: a critic that never saw
    # them predicts the markers' usual values, far from their returns
    for episode in episodes:
        if episode.episode_id in held_ids:
            episode.turns[-1].reward = -1.0 if episode.won else 1.0
    epochs = _record_training_order(monkeypatch)
    summary = train_critic(episodes, config, tmp_path / "run", progress=False)
    for order in epochs:
        assert len(order) == 24 and set(order) == {s.episode_id for s in samples} - held_ids
    assert summary["episodes"] == 24 and summary["heldout_episodes"] == 8
    last = summary["history"][-1]
    assert set(HELDOUT) <= set(last) and all(summary[key] == last[key] for key in HELDOUT)
    assert last["explained_variance"] > 0.3 and last["heldout_explained_variance"] < -0.5, last
    assert last["heldout_v_scored"] > last["heldout_v_unscored"]  # V still follows the markers
    assert last["heldout_auc_won_vs_lost"] == 1.0

    # the row's held-out numbers are those of the saved critic on exactly the held-out trajectories
    critic = load_critic(tmp_path / "run")
    held = [s for s in critic_samples(episodes, config) if s.episode_id in held_ids]
    predicted = predict_values(critic, held, progress=False)
    values = np.concatenate([v for v, _ in predicted])
    assert last["heldout_explained_variance"] == pytest.approx(
        explained_variance(values, torch.cat([s.mc_returns for s in held]).double().numpy()), abs=1e-6)
    assert last["heldout_v_mean"] == pytest.approx(values.mean(), abs=1e-6)
    first = np.array([v[0] for v, _ in predicted])
    won = np.array([s.won for s in held])
    assert last["heldout_auc_won_vs_lost"] == roc_auc(first[won], first[~won])
    rows = [json.loads(line) for line in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    assert all(set(HELDOUT) <= set(row) for row in rows) and len(rows) == 12
    assert sorted(torch.load(tmp_path / "run" / CRITIC_FILE, weights_only=False)["heldout"]) == sorted(held_ids)


@pytest.mark.parametrize("backbone", ["frozen", "lora"])
def test_resumed_heldout_training_equals_uninterrupted(tiny_critic_init, tmp_path, backbone):
    episodes = synthetic_buffer(12, seed=5)
    extra = {"backbone": "lora", "backbone_lr": 1e-3, "lora": {"r": 2}} if backbone == "lora" else {}
    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=3, heldout_fraction=0.3, **extra)
    full = train_critic(episodes, config, tmp_path / "a", progress=False)
    assert all(np.isfinite(row["heldout_explained_variance"]) for row in full["history"])
    steps_per_epoch = full["history"][0]["steps"]
    for stop in (steps_per_epoch + 1, steps_per_epoch):  # mid-epoch, and after an epoch's last step
        folder = tmp_path / f"b{stop}"
        assert not train_critic(episodes, config, folder, progress=False, stop_after_steps=stop)["finished"]
        resumed = train_critic(episodes, config, folder, progress=False)
        assert _without_seconds(resumed["history"]) == _without_seconds(full["history"])
        a, b = _weights(tmp_path / "a"), _weights(folder)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_changed_split_is_not_resumed(tiny_critic_init, tmp_path):
    episodes = synthetic_buffer(12, seed=5)
    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=2, heldout_fraction=0.3)
    train_critic(episodes, config, tmp_path / "run", progress=False, stop_after_steps=1)
    with pytest.raises(ValueError, match=r"cannot resume \(config differs in \['heldout_fraction'\]\)"):
        train_critic(episodes, config.model_copy(update={"heldout_fraction": 0.5}), tmp_path / "run", progress=False)
    episodes[0].won = not episodes[0].won  # same tokens and rewards, another outcome stratum
    with pytest.raises(ValueError, match=r"cannot resume \(the held-out trajectories differ"):
        train_critic(episodes, config, tmp_path / "run", progress=False)


def test_a_state_written_before_the_field_existed_resumes_with_the_default(tiny_critic_init, tmp_path):
    episodes = synthetic_buffer(8, seed=5)
    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=2)
    train_critic(episodes, config, tmp_path / "run", progress=False, stop_after_steps=1)
    state = torch.load(tmp_path / "run" / STATE_FILE, weights_only=False)
    del state["config"]["heldout_fraction"], state["heldout"]
    torch.save(state, tmp_path / "run" / STATE_FILE)
    assert train_critic(episodes, config, tmp_path / "run", progress=False)["finished"]


def test_a_variant_sets_the_field_and_a_bad_value_names_it():
    from qevolve.evolve.loop import _override

    main = CriticConfig()
    variant = _override(main, {"heldout_fraction": 0.25}, "variants.heldout_fit.critic")
    assert variant.heldout_fraction == 0.25 and main.heldout_fraction == 0.0
    assert variant.model_copy(update={"heldout_fraction": 0.0}) == main  # nothing else changed
    with pytest.raises(ValueError, match=r"^variants\.heldout_fit\.critic\.heldout_fraction: "):
        _override(main, {"heldout_fraction": 1.0}, "variants.heldout_fit.critic")
