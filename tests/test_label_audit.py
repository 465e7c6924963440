"""The label audit: the environment judges single actions (WebShop: product and option clicks against the
goal's target) and the audit asks whether the labels put the right ones above the wrong ones; and the label
summary's won/lost (``Episode.won``) beside scored/unscored (the critic's d)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from qevolve.buffer.store import Episode, Turn, write_episodes
from qevolve.cli import app
from qevolve.environments.judges import register_turn_judge, turn_judge
from qevolve.environments.webshop.catalog import Goal
from qevolve.environments.webshop.judge import OPTION, PRODUCT, judge_turns
from qevolve.evaluation.diagnostics import audit_line, audit_metrics, label_audit

GOAL = Goal(index=1600, asin="B000000001", instruction="i want red shoes, size 9",
            attributes=("shoes",), options=(("color", "red"), ("size", "9")), price_upper=50.0)
PRODUCTS = {"B000000001", "B000000002"}


def _episode(name, won, actions, advantages=None, env="webshop", task="goal-01600"):
    ep = Episode(f"{env}/train/{name}#0", task, env, "train", "self", won=won, score=1.0 if won else 0.5)
    for i, action in enumerate(actions):
        valid = not action.startswith("!")
        action = action.lstrip("!")
        ep.turns.append(Turn(observation="o", agent_text=f"Action: {action}", action=action or None,
                             format_valid=bool(action), action_valid=valid,
                             advantage=None if advantages is None else advantages[i], value=0.5, q_value=0.5))
    return ep


def test_webshop_judges_product_and_option_clicks_against_the_goals_target():
    episode = _episode("a", True, ["search[red shoes]", "click[b000000002]", "click[< Prev]", "click[B000000001]",
                                   "click[red]", "click[blue]", "!click[size 9]", "click[Description]", "",
                                   "click[size 9]", "click[Buy Now]"])
    assert judge_turns(episode, GOAL, PRODUCTS) == [
        None,  # a search
        (PRODUCT, False), None, (PRODUCT, True),  # another product, a button, the target (any case)
        (OPTION, True), (OPTION, False),  # an option the goal asks for; one it does not
        None, None, None,  # an action the environment rejected, a sub-page button, a format error
        (OPTION, True), None]  # "size 9" is a goal option by the reward's own rule; Buy Now is a button
    no_options = Goal(**{**GOAL.__dict__, "options": ()})
    assert judge_turns(episode, no_options, PRODUCTS)[4:6] == [None, None]  # nothing to judge an option by
    # the reward's option rule: upstream compares the text of the goal's (name, value) pair
    dark = Goal(**{**GOAL.__dict__, "options": (("color", "dark brown"),)})
    both = _episode("b", True, ["click[dark brown]"])
    assert judge_turns(both, dark, PRODUCTS) == [(OPTION, True)]


def test_the_registered_webshop_judge_reads_the_installed_goals(webshop_installed):
    from qevolve.environments.webshop.catalog import goal_index, load_catalog

    judge = turn_judge("webshop")
    goal = load_catalog().goals[goal_index("goal-01600")]
    other = next(asin for asin in sorted(load_catalog().products) if asin != goal.asin)
    episode = _episode("real", True, [f"click[{goal.asin.lower()}]", f"click[{other}]"])
    assert judge(episode) == [(PRODUCT, True), (PRODUCT, False)]
    with pytest.raises(ValueError, match="is not a goal of the installed catalogue"):
        judge(_episode("far", True, ["search[x]"], task="goal-99999"))
    assert turn_judge("no-such-environment") is None  # no judge registered: no audit


CLEAN_MUG = "pick_clean_then_place_in_recep-Mug-None-CoffeeMachine-10/trial_T20190909_000000_000000"


def test_alfworld_judges_valid_actions_that_serve_the_task_or_are_useless():
    from qevolve.environments.alfworld.judge import MOVE, TAKE, TRANSFORM, USE, judge_turns, task_goal

    goal = task_goal(CLEAN_MUG)
    assert (goal.task_type, goal.target, goal.receptacle) == ("pick_clean_then_place_in_recep", "mug", "coffeemachine")
    episode = _episode("a", True, ["go to countertop 1", "take apple 1 from countertop 1", "take mug 2 from countertop 1",
                                   "!take mug 1 from countertop 1", "heat mug 2 with microwave 1",
                                   "clean mug 2 with sinkbasin 1", "clean apple 1 with sinkbasin 1",
                                   "move apple 1 to coffeemachine 1", "put mug 2 in/on coffeemachine 1",
                                   "move mug 2 to countertop 2", "use desklamp 1", "examine mug 2", "look", ""],
                       env="alfworld", task=CLEAN_MUG)
    assert judge_turns(episode, goal) == [
        None,  # moving around is not judged
        (TAKE, False), (TAKE, True),  # another object; the task's
        None,  # rejected by the environment ("Nothing happens."): invalid, not useless
        (TRANSFORM, False), (TRANSFORM, True), (TRANSFORM, False),  # the wrong change; the task's; the wrong object
        (MOVE, False), (MOVE, True), (MOVE, False),  # another object; the task's (older wording); the wrong place
        (USE, False),  # a lamp, in a task that is not about looking at something under one
        None, None, None]  # examine, look and a format error are not judged
    look = task_goal("look_at_obj_in_light-AlarmClock-None-DeskLamp-301/trial_T1")
    lamp = _episode("b", True, ["take alarmclock 1 from desk 1", "use desklamp 1", "use floorlamp 1",
                                "move alarmclock 1 to desk 1"], env="alfworld", task=look.task_type)
    assert judge_turns(lamp, look) == [(TAKE, True), (USE, True), (USE, False), (MOVE, False)]
    with pytest.raises(ValueError, match="expected a game folder named"):
        task_goal("not-an-alfworld-task")


def test_the_registered_alfworld_judge_reads_the_task_id_and_drives_the_audit():
    judge = turn_judge("alfworld")
    assert judge is not None
    served = _episode("won", True, ["take mug 1 from countertop 1", "take apple 1 from countertop 1"],
                      advantages=[1.0, -1.0], env="alfworld", task=CLEAN_MUG)
    wasted = _episode("lost", False, ["take mug 1 from countertop 1", "take apple 1 from countertop 1"],
                      advantages=[0.5, 0.0], env="alfworld", task=CLEAN_MUG)
    assert judge(served) == [("take", True), ("take", False)]
    audit = label_audit([served, wasted], standardize="none")
    (row,) = [r for r in audit["rows"] if r["action_kind"] == "take" and r["outcome"] == "all"]
    assert (row["correct"], row["wrong"]) == (2, 2)
    assert row["auc_correct_vs_wrong"] == pytest.approx(1.0)  # every useful take above every useless one
    assert audit_metrics(audit)["audit_take_auc"] == pytest.approx(1.0)


def _audit_buffer():
    # standardised as the policy stage does; "x" marks a turn the test judge leaves out
    won = _episode("w", True, ["right", "wrong", "right", "x"], [0.9, -0.1, 0.5, 0.0], env="toy")
    lost = _episode("l", False, ["wrong", "right", "wrong"], [-0.5, 0.1, 0.3], env="toy")
    return [won, lost]


def _toy_judge(episode):
    return [None if turn.action == "x" else ("pick", turn.action == "right") for turn in episode.turns]


def test_label_audit_against_a_plain_loop():
    episodes = _audit_buffer()
    audit = label_audit(episodes, judge=_toy_judge)
    labels = np.array([0.9, -0.1, 0.5, 0.0, -0.5, 0.1, 0.3])
    standard = (labels - labels.mean()) / labels.std()
    assert (audit["shift"], audit["scale"]) == (pytest.approx(labels.mean()), pytest.approx(labels.std()))
    rows = {row["outcome"]: row for row in audit["rows"]}
    assert [row["action_kind"] for row in audit["rows"]] == ["pick"] * 3 and audit["judged_turns"] == 6
    counts = [(rows[outcome]["correct"], rows[outcome]["wrong"]) for outcome in ("won", "lost")]
    assert counts == [(2, 1), (1, 2)]
    assert rows["won"]["advantage_correct"] == pytest.approx(standard[[0, 2]].mean())
    assert rows["lost"]["advantage_wrong"] == pytest.approx(standard[[4, 6]].mean())
    assert rows["won"]["auc_correct_vs_wrong"] == 1.0  # 0.9 and 0.5 above -0.1
    assert rows["lost"]["auc_correct_vs_wrong"] == 0.5  # 0.1 above -0.5, below 0.3
    # every correct turn against every wrong one: 0.9 > all 3, 0.5 > all 3, 0.1 > 2 of 3
    assert rows["all"]["auc_correct_vs_wrong"] == pytest.approx(8 / 9)
    assert rows["all"]["pushed_down_wrong"] == pytest.approx(np.mean(standard[[1, 4, 6]] < 0))
    # the AUC is the labels' own (standardisation keeps their order); the means are in the mode's units
    raw = label_audit(episodes, standardize="none", judge=_toy_judge)
    assert [r["auc_correct_vs_wrong"] for r in raw["rows"]] == [r["auc_correct_vs_wrong"] for r in audit["rows"]]
    assert raw["rows"][0]["advantage_correct"] == pytest.approx(0.7)
    metrics = audit_metrics(audit)
    assert metrics["audit_pick_auc"] == pytest.approx(8 / 9) and metrics["audit_pick_auc_won"] == 1.0
    assert (metrics["audit_pick_correct"], metrics["audit_pick_wrong"]) == (3, 3)
    assert "pick 3 correct / 3 wrong" in audit_line(audit) and "AUC 0.89 (won 1.00, lost 0.50)" in audit_line(audit)
    # one outcome without a wrong turn: its AUC is None, and left out of the metrics
    only_right = label_audit([_audit_buffer()[0]], judge=lambda ep: [("pick", True)] * ep.num_turns)
    assert only_right["rows"][0]["auc_correct_vs_wrong"] is None
    assert "audit_pick_auc" not in audit_metrics(only_right)


def test_label_audit_refuses_unlabelled_or_mixed_buffers_and_skips_environments_without_a_judge():
    with pytest.raises(ValueError, match="has no advantage"):
        label_audit([_episode("u", True, ["right"])], judge=_toy_judge)
    mixed = [_episode("a", True, ["x"], [0.0], env="webshop"), _episode("b", True, ["x"], [0.0], env="alfworld")]
    with pytest.raises(ValueError, match="mixes environments"):
        label_audit(mixed)
    assert label_audit([_episode("a", True, ["go"], [0.0], env="sciworld")]) is None  # no judge: no audit
    # an environment given as module:name finds the judge registered under its name
    register_turn_judge("CounterEnv", lambda: _toy_judge)
    counter = [_episode(n, won, ["right", "wrong"], [1.0, -1.0], env="qevolve.environments.testing:CounterEnv")
               for n, won in (("a", True), ("b", False))]
    assert label_audit(counter)["rows"][-1]["auc_correct_vs_wrong"] == 1.0


def test_the_judge_of_the_own_environment_doc_registers_and_judges():
    import re
    from pathlib import Path

    from qevolve.environments import judges

    doc = (Path(__file__).resolve().parents[1] / "docs" / "own-environment.md").read_text()
    block = next(body for body in re.findall(r"^```python\n(.*?)^```", doc, re.S | re.M)
                 if "register_turn_judge" in body)
    namespace: dict = {}
    exec(block, namespace)
    judge = judges._JUDGES.pop("rooms")()
    episode = _episode("r", True, ["go to kitchen", "open door", ""], env="rooms_game:rooms")
    assert judge(episode) == [("open", False), ("open", True), None]


def test_cli_label_audit(tmp_path, webshop_installed):
    from qevolve.environments.webshop.catalog import goal_index, load_catalog

    goal = load_catalog().goals[goal_index("goal-01600")]
    other = next(asin for asin in sorted(load_catalog().products) if asin != goal.asin)
    episodes = [_episode("w", True, ["search[x]", f"click[{goal.asin}]", "click[Buy Now]"], [0.1, 0.8, 0.2]),
                _episode("l", False, ["search[x]", f"click[{other}]", "click[Buy Now]"], [0.0, -0.6, -0.2])]
    write_episodes(tmp_path / "labelled.parquet", episodes)
    runner = CliRunner()
    result = runner.invoke(app, ["data", "label-audit", str(tmp_path / "labelled.parquet")])
    assert result.exit_code == 0, result.output
    assert "2 episodes (1 won), 6 turns, 2 judged" in result.output
    assert "| click[product] | all     | 1       | 1     |" in result.output
    result = runner.invoke(app, ["data", "label-audit", str(tmp_path / "labelled.parquet"), "--json"])
    audit = json.loads(result.output)
    assert audit["rows"][-1]["auc_correct_vs_wrong"] == 1.0
    episodes = [_episode("a", True, ["go"], [0.0], env="sciworld")]
    write_episodes(tmp_path / "alf.parquet", episodes)
    result = runner.invoke(app, ["data", "label-audit", str(tmp_path / "alf.parquet")])
    # the error panel wraps its text at the terminal's width, at a place that depends on the tmp path's length
    unwrapped = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2 and "environment sciworld has no turn judge" in unwrapped


def test_the_label_summary_splits_by_won_and_by_positive_final_score(tiny_critic_init, tmp_path):
    from qevolve.critic.testing import synthetic_buffer, tiny_critic_config
    from qevolve.critic.train import load_critic, train_critic
    from qevolve.process_rewards.label import LabelConfig, label_episodes

    episodes = synthetic_buffer(8, seed=3)  # 4 won, 4 lost
    lost = next(ep for ep in episodes if not ep.won)
    lost.score = lost.turns[-1].reward = 0.5  # a purchase of the wrong size: it scored, and is lost
    config = tiny_critic_config(tiny_critic_init, tmp_path, epochs=2, diagnostics={"folds": 0})
    train_critic(episodes, config, tmp_path / "run", progress=False)
    labelled, summary = label_episodes(episodes, load_critic(tmp_path / "run"), LabelConfig(), progress=False)
    assert (summary["episodes_won"], summary["episodes_scored"]) == (4, 5)
    for name, keep in (("won", lambda ep: ep.won), ("lost", lambda ep: not ep.won),
                       ("scored", lambda ep: ep.score > 0), ("unscored", lambda ep: ep.score == 0)):
        chosen = [ep for ep in labelled if keep(ep)]
        assert summary[f"v0_{name}"] == pytest.approx(np.mean([ep.turns[0].value for ep in chosen]))
        assert summary[f"v_mean_{name}"] == pytest.approx(np.mean([t.value for ep in chosen for t in ep.turns]))
        assert summary[f"advantage_mean_{name}"] == pytest.approx(
            np.mean([t.advantage for ep in chosen for t in ep.turns]))
    assert summary["v_mean_lost"] != pytest.approx(summary["v_mean_unscored"])  # the scored loss moved between them
    assert summary["value_source"] == "ema" and "v0_success" not in summary


def test_the_alfworld_judge_finds_every_judged_expert_action_useful(alfworld_installed):
    """Real games, real text: ALFWorld's expert demonstrations, two of each task type (interleaved), replayed in
    the environment. The expert does only what its task needs, so every action the judge can judge is correct,
    and every kind of judged action occurs."""
    from qevolve.environments.alfworld import alfworld_expert_jobs
    from qevolve.environments.play import play_jobs

    jobs, _ = alfworld_expert_jobs(split="train", limit=12)
    result = play_jobs("alfworld", jobs, split="train", num_workers=2, progress=False)
    won = [ep for ep in result.episodes if ep.won]
    assert len(won) >= 10, result.metrics
    judge = turn_judge("alfworld")
    verdicts = [verdict for ep in won for verdict in judge(ep) if verdict is not None]
    assert {kind for kind, _ in verdicts} == {"take", "move", "transform", "use"}
    assert all(correct for _, correct in verdicts), [v for v in verdicts if not v[1]]
