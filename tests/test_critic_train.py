"""Training the critic end to end on synthetic buffers with a tiny random Llama; labelling; the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from qevolve.buffer.store import read_episodes, write_episodes
from qevolve.config import ConfigError, load_config
from qevolve.critic.testing import synthetic_buffer, tiny_critic_config
from qevolve.critic.train import (CRITIC_FILE, METRICS_FILE, STATE_FILE, critic_samples, load_critic, predict_values,
                                  train_critic)
from qevolve.process_rewards.label import LabelConfig, label_episodes


# torch runs on one thread in the tests (tests/conftest.py): tiny tensors, shared CPU.



def test_frozen_critic_ranks_success_above_failure_on_held_out(tiny_critic_init, tmp_path):
    train = synthetic_buffer(48, seed=1, min_turns=1, max_turns=5)
    held_out = synthetic_buffer(16, seed=99, min_turns=1, max_turns=5)
    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=40, iql={"polyak": 0.05}, checkpoint_every_steps=10_000)
    summary = train_critic(train, config, tmp_path / "run", progress=False)
    assert summary["finished"] and len(summary["history"]) == 40
    history = summary["history"]
    assert history[-1]["loss_q"] < history[0]["loss_q"]
    assert history[-1]["v_scored"] > history[-1]["v_unscored"]  # by final score > 0 (synthetic: = won)

    critic = load_critic(tmp_path / "run")
    predictions = predict_values(critic, critic_samples(held_out, config), progress=False)
    v_won = [v.mean() for (v, _), ep in zip(predictions, held_out) if ep.won]
    v_lost = [v.mean() for (v, _), ep in zip(predictions, held_out) if not ep.won]
    assert min(v_won) > max(v_lost), (v_won, v_lost)

    rows = [json.loads(line) for line in (tmp_path / "run" / METRICS_FILE).read_text().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, 41))
    assert {"loss_v", "loss_q", "v_scored", "v_unscored", "explained_variance"} <= set(rows[0])
    assert not {"v_success", "v_failure"} & set(rows[0])  # the former names, which read as won/lost
    assert rows[-1]["explained_variance"] > rows[0]["explained_variance"]


def test_resumed_training_equals_uninterrupted(tiny_critic_init, tmp_path):
    episodes = synthetic_buffer(12, seed=5)
    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=3)
    full = train_critic(episodes, config, tmp_path / "a", progress=False)
    # stopped in the second epoch: its state holds the first epoch's history line and the open epoch
    partial = train_critic(episodes, config, tmp_path / "b", progress=False,
                           stop_after_steps=full["history"][0]["steps"] + 1)
    assert not partial["finished"] and (tmp_path / "b" / STATE_FILE).is_file()
    # a state as versions before the v_scored rename wrote it: it resumes under today's names
    state = torch.load(tmp_path / "b" / STATE_FILE, weights_only=False)
    renames = {"v_scored": "v_success", "v_unscored": "v_failure"}
    assert state["history"] and "scored" in state["accumulator"]
    state["history"] = [{renames.get(k, k): v for k, v in line.items()} for line in state["history"]]
    state["accumulator"]["success"] = state["accumulator"].pop("scored")
    torch.save(state, tmp_path / "b" / STATE_FILE)
    assert not (tmp_path / "b" / CRITIC_FILE).exists()
    resumed = train_critic(episodes, config, tmp_path / "b", progress=False)
    assert resumed["global_step"] == full["global_step"]
    a = torch.load(tmp_path / "a" / CRITIC_FILE, weights_only=False)
    b = torch.load(tmp_path / "b" / CRITIC_FILE, weights_only=False)
    for key in ("heads", "target_q"):
        for name, tensor in a[key].items():
            torch.testing.assert_close(b[key][name], tensor, rtol=0, atol=0)
    assert [r["loss_q"] for r in a["history"]] == pytest.approx([r["loss_q"] for r in b["history"]])
    assert [r["v_scored"] for r in a["history"]] == pytest.approx([r["v_scored"] for r in b["history"]])

    changed = tiny_critic_config(tiny_critic_init, tmp_path, epochs=3, lr=1e-3)
    train_critic(episodes, config, tmp_path / "c", progress=False, stop_after_steps=1)
    with pytest.raises(ValueError, match=r"cannot resume \(config differs in \['lr'\]\)"):
        train_critic(episodes, changed, tmp_path / "c", progress=False)
    with pytest.raises(ValueError, match="the buffer differs"):
        train_critic(synthetic_buffer(12, seed=6), config, tmp_path / "c", progress=False)


def test_lora_critic_trains_saves_and_reloads(tiny_critic_init, tmp_path):
    episodes = synthetic_buffer(6, seed=2, max_turns=3)
    config = tiny_critic_config(tiny_critic_init, tmp_path, backbone="lora", epochs=2, backbone_lr=1e-3, lora={"r": 2})
    summary = train_critic(episodes, config, tmp_path / "lora", progress=False)
    assert all(np.isfinite(r["loss_q"]) for r in summary["history"])
    saved = torch.load(tmp_path / "lora" / CRITIC_FILE, weights_only=False)
    lora_b = [t for name, t in saved["backbone"].items() if "lora_B" in name]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b)  # LoRA B starts at zero: it trained
    first = predict_values(load_critic(tmp_path / "lora"), critic_samples(episodes, config), progress=False)
    second = predict_values(load_critic(tmp_path / "lora"), critic_samples(episodes, config), progress=False)
    for (v1, q1), (v2, q2) in zip(first, second):
        np.testing.assert_array_equal(v1, v2)
        np.testing.assert_array_equal(q1, q2)


def test_labelling_twice_gives_identical_output(tiny_critic_init, tmp_path):
    episodes = synthetic_buffer(10, seed=7)
    episodes[0].turns[0].action_valid = False
    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=2)
    train_critic(episodes, config, tmp_path / "run", progress=False)
    write_episodes(tmp_path / "buffer.parquet", episodes)
    outputs = []
    for attempt in range(2):
        critic = load_critic(tmp_path / "run")
        labelled, summary = label_episodes(read_episodes(tmp_path / "buffer.parquet"), critic, LabelConfig(),
                                           progress=False)
        path = write_episodes(tmp_path / f"labelled-{attempt}.parquet", labelled)
        outputs.append(read_episodes(path))
    assert outputs[0] == outputs[1]
    turns = [t for ep in outputs[0] for t in ep.turns]
    assert all(t.value is not None and t.q_value is not None and t.advantage is not None for t in turns)
    assert outputs[0][0].turns[0].r_aux == pytest.approx(-0.2)
    assert summary["turns"] == len(turns)


def test_label_estimators_and_standardisation(tiny_critic_init, tmp_path):
    episodes = synthetic_buffer(8, seed=8)
    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=1)
    train_critic(episodes, config, tmp_path / "run", progress=False)
    critic = load_critic(tmp_path / "run")
    labelled, _ = label_episodes(synthetic_buffer(8, seed=8), critic, LabelConfig(estimator="q_minus_v"), progress=False)
    for turn in (t for ep in labelled for t in ep.turns):
        assert turn.advantage == pytest.approx(turn.q_value - turn.value)
    labelled, summary = label_episodes(synthetic_buffer(8, seed=8), critic,
                                       LabelConfig(estimator="td1", standardize=True), progress=False)
    advantages = np.array([t.advantage for ep in labelled for t in ep.turns])
    assert advantages.mean() == pytest.approx(0.0, abs=1e-9) and advantages.std() == pytest.approx(1.0, rel=1e-6)
    # gigpo reads no value: given a critic, its labels are those without one at the critic's discount
    labelled, summary = label_episodes(synthetic_buffer(8, seed=8), critic, LabelConfig(estimator="gigpo"),
                                       progress=False)
    alone, _ = label_episodes(synthetic_buffer(8, seed=8), None,
                              LabelConfig(estimator="gigpo", gamma=critic.config.iql.gamma), progress=False)
    assert [t.advantage for ep in labelled for t in ep.turns] == [t.advantage for ep in alone for t in ep.turns]
    assert summary["gamma"] == critic.config.iql.gamma and "turns_in_step_groups" in summary


def test_label_q_source_online_by_default_or_target(tiny_critic_init, tmp_path):
    """Q - V reads the online Q heads (the method's Q) unless q_source=target asks for Qbar."""
    import copy

    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=1)
    train_critic(synthetic_buffer(6, seed=3), config, tmp_path / "run", progress=False)
    critic = load_critic(tmp_path / "run")
    # make Qbar differ from Q by exactly +1: a copy of the online heads with 1 added to the output bias
    critic.target_q = copy.deepcopy(critic.heads.q).requires_grad_(False)
    with torch.no_grad():
        for head in critic.target_q:
            head[-1].bias += 1.0
    assert LabelConfig().q_source == "online"
    online, summary = label_episodes(synthetic_buffer(6, seed=3), critic, LabelConfig(estimator="q_minus_v"),
                                     progress=False)
    target, _ = label_episodes(synthetic_buffer(6, seed=3), critic,
                               LabelConfig(estimator="q_minus_v", q_source="target"), progress=False)
    assert summary["q_source"] == "online"
    for a, b in zip((t for ep in online for t in ep.turns), (t for ep in target for t in ep.turns)):
        assert b.q_value == pytest.approx(a.q_value + 1.0, abs=1e-5)
        assert a.advantage == pytest.approx(a.q_value - a.value) and b.advantage == pytest.approx(a.advantage + 1.0,
                                                                                                   abs=1e-5)
    with pytest.raises(ConfigError, match="field 'q_source'"):
        load_config(LabelConfig, None, ["q_source=qbar"])


def test_cli_critic_and_label(tiny_critic_init, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from qevolve.cli import app

    monkeypatch.setenv("QEVOLVE_DATA_DIR", str(tmp_path / "data"))
    episodes = synthetic_buffer(8, seed=9)
    write_episodes(tmp_path / "buffer.parquet", episodes)
    config_path = tmp_path / "critic.yaml"
    config_path.write_text("epochs: 2\ndtype: float32\nbatch_tokens: 256\nhead_hidden: 16\n")
    runner = CliRunner()
    result = runner.invoke(app, ["critic", "--buffer", str(tmp_path / "buffer.parquet"), "--init", str(tiny_critic_init),
                                 "--output", str(tmp_path / "critic"), "--config", str(config_path), "--no-progress",
                                 "iql.expectile=0.8"])
    assert result.exit_code == 0, result.output
    assert "explained_variance" in result.output and (tmp_path / "critic" / CRITIC_FILE).is_file()
    assert "expectile: 0.8" in (tmp_path / "critic" / "config.yaml").read_text()
    result = runner.invoke(app, ["label", "--buffer", str(tmp_path / "buffer.parquet"), "--critic",
                                 str(tmp_path / "critic"), "--output", str(tmp_path / "labelled.parquet"),
                                 "--no-progress", "estimator=gae_env_aux"])
    assert result.exit_code == 0, result.output
    assert "gae_env_aux" in result.output
    labelled = read_episodes(tmp_path / "labelled.parquet")
    assert all(t.advantage is not None for ep in labelled for t in ep.turns)
    result = runner.invoke(app, ["label", "--buffer", str(tmp_path / "buffer.parquet"), "--critic",
                                 str(tmp_path / "critic"), "--output", str(tmp_path / "x.parquet"), "estimator=nope"])
    assert result.exit_code != 0


def test_untokenised_buffer_without_the_prompt_builder_is_a_clear_error(monkeypatch, tmp_path):
    import sys

    from qevolve.critic.data import ensure_tokenized

    episodes = synthetic_buffer(2, seed=1)
    assert ensure_tokenized(episodes, tmp_path) is episodes  # already tokenised: nothing to do
    episodes[1].turns[0].context_ids = None
    monkeypatch.setitem(sys.modules, "qevolve.prompting", None)  # makes the import fail
    with pytest.raises(ValueError, match="buf.parquet: 1 episodes have no token ids.*tokenise the buffer first"):
        ensure_tokenized(episodes, tmp_path, source="buf.parquet")


def test_a_critic_whose_mean_value_still_moves_is_reported_unconverged(tiny_critic_init, tmp_path):
    from qevolve.critic.train import UNCONVERGED_V_CHANGE, unconverged_warning

    assert unconverged_warning([{"epoch": 1, "steps": 4, "v_mean": 0.2}]) is None  # one epoch: nothing to compare
    moving = [{"epoch": 1, "steps": 4, "v_mean": 0.50}, {"epoch": 2, "steps": 8, "v_mean": 0.50 + 2 * UNCONVERGED_V_CHANGE}]
    assert "moved by +0.0200 in the last epoch" in unconverged_warning(moving)
    assert "not converged after 2 epochs (8 steps); raise epochs or iql.polyak" in unconverged_warning(moving)
    moving[-1]["v_mean"] = 0.50 - UNCONVERGED_V_CHANGE / 2
    assert unconverged_warning(moving) is None
    # two epochs from random heads at a high learning rate: V is still moving, and the run says so
    messages: list[str] = []
    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=2, lr=3e-2, checkpoint_every_steps=10_000)
    summary = train_critic(synthetic_buffer(12, seed=5), config, tmp_path / "run", progress=False, log=messages.append)
    change = summary["history"][-1]["v_mean"] - summary["history"][-2]["v_mean"]
    assert summary["converged"] is (abs(change) <= UNCONVERGED_V_CHANGE)
    assert any(m.startswith("WARNING: critic: the mean V moved") for m in messages) is not summary["converged"]
    assert not summary["converged"], change  # this setting moves V by far more than the tolerance


def test_a_state_saved_with_the_old_penalties_table_resumes():
    """Critic states written while the built-in environments' penalties were the config's default hold
    that table in their config; it drops out through today's schema, so training continues from them."""
    from qevolve.critic.config import CriticConfig
    from qevolve.critic.train import FORMAT_VERSION, _same_run

    config = CriticConfig()
    saved = config.model_dump(mode="json")
    saved["retrospective"]["penalties"] = {
        "alfworld": {"format_error": -0.3, "invalid_action": -0.2, "repeat": -0.1},
        "sciworld": {"format_error": -0.3, "invalid_action": -0.2, "repeat": -0.1},
        "webshop": {"format_error": -0.3, "invalid_action": 0.0, "repeat": 0.0}}
    state = {"format": FORMAT_VERSION, "config": saved, "init": "model", "fingerprint": "buffer", "heldout": []}
    assert _same_run(state, config, "model", "buffer", []) is None
    saved["retrospective"]["penalties"]["webshop"]["repeat"] = -0.1  # another reward: not the same run
    assert _same_run(state, config, "model", "buffer", []) == "config differs in ['retrospective']"
