"""`qevolve data advantages`: advantages by action kind and outcome, labelled and as the policy stage sees them."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from qevolve.buffer.store import Episode, Turn, write_episodes
from qevolve.cli import app
from qevolve.evaluation.diagnostics import action_kind, advantage_by_action_kind


@pytest.mark.parametrize("env, action, kind", [
    ("webshop", "search[red shoes size 9]", "search"),
    ("webshop", "click[Buy Now]", "click[buy now]"),
    ("webshop", "click[< Prev]", "click[< prev]"),
    ("webshop", "click[B07ZJ6Z3Q1]", "click[product]"),
    ("webshop", "click[size 9]", "click[option]"),
    ("webshop", "buy it", "(unparsed)"),
    ("webshop", None, "(none)"),
    ("alfworld", "go to desk 1", "go to"),
    ("alfworld", "take apple 1 from desk 1", "take"),
    ("sciworld", "look around", "look around"),
    ("sciworld", "pick up thermometer", "pick up"),
])
def test_action_kind(env, action, kind):
    assert action_kind(env, action) == kind


def _episode(name, won, actions_and_advantages, failed=False):
    ep = Episode(f"webshop/train/{name}#0", name, "webshop", "train", "self", won=won, score=float(won),
                 failed=failed)
    for action, advantage in actions_and_advantages:
        ep.turns.append(Turn(observation="o", agent_text=f"Action: {action}", action=action, advantage=advantage,
                             value=0.5, q_value=0.6))
    return ep


def _buffer():
    # A won episode whose purchase carries a small positive advantage (V has already risen) and a lost one.
    return [_episode("g0", True, [("search[x]", 0.30), ("click[B000000001]", 0.20), ("click[Buy Now]", 0.02)]),
            _episode("g1", False, [("search[x]", 0.05), ("click[Buy Now]", -0.40)]),
            _episode("g2", False, [("click[Buy Now]", 9.0)], failed=True)]  # left out, as the policy stage does


def _row(table, kind, outcome):
    return next(r for r in table["rows"] if r["action_kind"] == kind and r["outcome"] == outcome)


def test_buffer_centring_pushes_a_won_purchase_down_and_buffer_scale_does_not():
    labelled = np.array([0.30, 0.20, 0.02, 0.05, -0.40])  # the failed episode's turn is not trained on
    mean, std = labelled.mean(), labelled.std()
    centred = advantage_by_action_kind(_buffer(), "buffer")
    assert centred["turns"] == 5 and centred["episodes"] == 2
    won_buy = _row(centred, "click[buy now]", "won")
    assert won_buy["turns"] == 1 and won_buy["advantage"] == pytest.approx(0.02)
    assert won_buy["standardized"] == pytest.approx((0.02 - mean) / std) and won_buy["standardized"] < 0
    assert won_buy["pushed_down"] == 1.0
    assert _row(centred, "search", "lost")["pushed_down"] == 0.0  # 0.05 is above the buffer mean 0.034
    scaled = advantage_by_action_kind(_buffer(), "buffer_scale")
    assert _row(scaled, "click[buy now]", "won")["standardized"] == pytest.approx(0.02 / std)
    assert _row(scaled, "click[buy now]", "won")["pushed_down"] == 0.0
    assert _row(scaled, "click[buy now]", "lost")["pushed_down"] == 1.0
    raw = advantage_by_action_kind(_buffer(), "none")
    assert _row(raw, "click[buy now]", "lost")["standardized"] == pytest.approx(-0.40)
    assert _row(raw, "search", "won")["V"] == 0.5 and _row(raw, "search", "won")["Q"] == 0.6


def test_unlabelled_buffer_and_unknown_mode_are_refused():
    episodes = _buffer()
    episodes[0].turns[1].advantage = None
    with pytest.raises(ValueError, match="episode 'webshop/train/g0#0' turn 1 has no advantage.*qevolve label"):
        advantage_by_action_kind(episodes)
    with pytest.raises(ValueError, match="standardize: expected one of buffer, buffer_scale, none, got 'step'"):
        advantage_by_action_kind(_buffer(), "step")


def test_cli_prints_the_table_and_json(tmp_path):
    path = tmp_path / "labelled.parquet"
    write_episodes(path, _buffer())
    result = CliRunner().invoke(app, ["data", "advantages", str(path)])
    assert result.exit_code == 0, result.output
    assert "2 episodes, 5 turns; standardize=buffer" in result.output and "click[buy now]" in result.output
    result = CliRunner().invoke(app, ["data", "advantages", str(path), "--standardize", "buffer_scale", "--json"])
    assert result.exit_code == 0, result.output
    table = json.loads(result.output)
    assert table["shift"] == 0.0 and _row(table, "click[buy now]", "won")["pushed_down"] == 0.0
    result = CliRunner().invoke(app, ["data", "advantages", str(tmp_path / "missing.parquet")], env={"COLUMNS": "500"})
    assert result.exit_code != 0 and "missing.parquet" in result.output


def test_action_kind_counts_and_cli(tmp_path):
    from qevolve.evaluation.diagnostics import action_kind_counts

    table = action_kind_counts(_buffer())
    assert table["episodes"] == 3 and table["won"] == 1 and table["actions"] == 6
    buy = next(r for r in table["rows"] if r["action_kind"] == "click[buy now]")
    assert buy == {"action_kind": "click[buy now]", "actions": 3, "share": 0.5, "episodes_with": 3,
                   "invalid": 0.0, "repeated": 0.0}
    # a policy that loops on an option the page does not offer: rejected, and the same click again
    looping = _episode("g3", False, [("search[x]", 0.0), ("click[size 9]", 0.0), ("click[Size 9] ", 0.0),
                                     ("click[size 9]", 0.0), ("click[red]", 0.0)])
    for turn in looping.turns[1:]:
        turn.action_valid = False
    option = next(r for r in action_kind_counts([looping])["rows"] if r["action_kind"] == "click[option]")
    assert option["actions"] == 4 and option["invalid"] == 1.0 and option["repeated"] == 0.5
    path = tmp_path / "eval.parquet"
    write_episodes(path, _buffer())
    result = CliRunner().invoke(app, ["data", "actions", str(path)])
    assert result.exit_code == 0, result.output
    assert "3 episodes (1 won), 6 actions" in result.output and "click[product]" in result.output


def _valued(name, won, rewards_and_values):
    ep = Episode(f"webshop/train/{name}#0", name, "webshop", "train", "self", won=won, score=rewards_and_values[-1][0])
    for reward, value in rewards_and_values:
        ep.turns.append(Turn(observation="o", agent_text="Action: search[x]", action="search[x]", reward=reward,
                             value=value, advantage=0.0))
    return ep


def test_critic_fit_against_a_plain_loop():
    from qevolve.evaluation.diagnostics import critic_fit

    episodes = [_valued("g0", True, [(0.0, 0.7), (0.0, 0.8), (1.0, 0.9)]),
                _valued("g1", False, [(0.0, 0.6), (0.0, 0.5)]),
                _valued("g2", True, [(0.0, 0.4), (1.0, 0.95)])]
    fit = critic_fit(episodes, gamma=0.9)
    # the discounted return-to-go, by hand
    g = np.array([0.81, 0.9, 1.0, 0.0, 0.0, 0.9, 1.0])
    v = np.array([0.7, 0.8, 0.9, 0.6, 0.5, 0.4, 0.95])
    assert fit["turns"] == 7 and fit["won"] == 2
    assert fit["all_turns"]["explained_variance"] == pytest.approx(1 - np.var(g - v) / np.var(g))
    assert fit["all_turns"]["correlation"] == pytest.approx(np.corrcoef(v, g)[0, 1])
    assert fit["all_turns"]["bias"] == pytest.approx(np.mean(v - g))
    first_v, first_g = np.array([0.7, 0.6, 0.4]), np.array([0.81, 0.0, 0.9])
    assert fit["first_turn"]["correlation"] == pytest.approx(np.corrcoef(first_v, first_g)[0, 1])
    # won first-turn values 0.7 and 0.4 against the lost 0.6: one of two pairs ranked right
    assert fit["first_turn"]["auc_won_vs_lost"] == pytest.approx(0.5)
    assert fit["by_turn"][1] == {"turn": 1, "won_turns": 2, "V_won": pytest.approx(0.875),
                                 "G_won": pytest.approx(0.95), "lost_turns": 1, "V_lost": 0.5, "G_lost": 0.0}
    assert fit["by_turn"][2]["lost_turns"] == 0 and fit["by_turn"][2]["V_lost"] is None


def test_critic_fit_refuses_an_unlabelled_buffer_and_the_cli_reports(tmp_path):
    from qevolve.evaluation.diagnostics import critic_fit

    episodes = [_valued("g0", True, [(0.0, 0.7), (1.0, None)]), _valued("g1", False, [(0.0, 0.6)])]
    with pytest.raises(ValueError, match="episode 'webshop/train/g0#0' turn 1 has no value V; label the buffer"):
        critic_fit(episodes)
    with pytest.raises(ValueError, match="gamma: expected a value in \\[0, 1\\], got 1.5"):
        critic_fit(episodes, gamma=1.5)
    path = tmp_path / "labelled.parquet"
    episodes[0].turns[1].value = 0.9
    write_episodes(path, episodes)
    runner = CliRunner()
    shown = runner.invoke(app, ["data", "critic-fit", str(path)])
    assert shown.exit_code == 0, shown.output
    assert "auc_won_vs_lost" in shown.output and "| first" in shown.output
    as_json = json.loads(runner.invoke(app, ["data", "critic-fit", str(path), "--json"]).output)
    assert as_json["first_turn"]["auc_won_vs_lost"] == 1.0
    bad = runner.invoke(app, ["data", "critic-fit", str(tmp_path / "missing.parquet")], env={"COLUMNS": "500"})
    assert bad.exit_code != 0 and "missing.parquet" in bad.output
