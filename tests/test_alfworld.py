"""ALFWorld on the real games (no mocks)."""

import random

import pytest

from qevolve.environments import make_environment
from qevolve.environments.alfworld.expert import alfworld_expert_jobs, map_legacy_action
from qevolve.environments.play import play_jobs, scripted_jobs

pytestmark = pytest.mark.usefixtures("alfworld_installed")


def test_splits_and_stable_task_ids():
    env = make_environment("alfworld")
    try:
        assert len(env.tasks("train")) == 3553
        assert len(env.tasks("seen")) == 140
        assert len(env.tasks("unseen")) == 134
        first = env.tasks("unseen")[0]
        assert first == "look_at_obj_in_light-AlarmClock-None-DeskLamp-308/trial_T20190908_222917_366542"
    finally:
        env.close()


def test_invalid_action_is_flagged_and_admissible_actions_listed():
    env = make_environment("alfworld", split="seen")
    try:
        obs = env.reset(env.tasks("seen")[0])
        assert "Your task is to:" in obs and "Welcome" not in obs
        admissible = env.admissible_actions()
        assert 5 <= len(admissible) and all(isinstance(a, str) for a in admissible)
        bad = env.step("fly to the moon")
        assert bad.observation == "Nothing happens."
        assert bad.info["valid_action"] is False and bad.reward == 0.0 and not bad.done
        good = env.step(admissible[0])
        assert good.info["valid_action"] is True
    finally:
        env.close()


@pytest.mark.parametrize("split", ["seen", "unseen"])
def test_walkthrough_replay_wins_on_a_sample(split):
    jobs = scripted_jobs("alfworld", split, "walkthrough")
    jobs = random.Random(0).sample(jobs, 4)
    result = play_jobs("alfworld", jobs, split=split, num_workers=2, progress=False)
    assert not result.failures
    assert [ep.won for ep in result.episodes] == [True] * 4
    for ep in result.episodes:
        assert ep.turns[-1].done and ep.turns[-1].reward == 1.0 and ep.score == 1.0
        assert all(t.reward == 0.0 for t in ep.turns[:-1])


def test_human_demonstrations_replay_and_win():
    assert map_legacy_action("put mug 1 in/on desk 2") == "move mug 1 to desk 2"
    assert map_legacy_action("go to desk 1") == "go to desk 1"
    jobs, dropped = alfworld_expert_jobs(split="train", limit=3)
    assert len(jobs) == 3 and not dropped
    result = play_jobs("alfworld", jobs, split="train", num_workers=2, progress=False)
    assert all(ep.won and ep.source == "expert" for ep in result.episodes)
    ep = result.episodes[0]
    # Observations come from the real game: the first names the task, later ones answer actions.
    assert "Your task is to:" in ep.turns[0].observation
    assert ep.turns[1].observation == ep.next_observation(0) != ""


_TRANSCRIPT_SCRIPT = """
import json, sys
import qevolve.environments.alfworld.env as alfworld_env
plain = sys.argv[1] == "plain"
if plain:  # TextWorld exactly as shipped: no shared translations or parses
    alfworld_env._share_textworld_parses = lambda: None
env = alfworld_env.AlfWorldEnv("seen")
out = []
for task in env.tasks("seen")[::47]:
    lines = [env.reset(task), sorted(env.admissible_actions())]
    for action in env.expert_actions() + ["fly to the moon"]:
        lines += [env.step(action).observation, sorted(env.admissible_actions())]
    out.append(lines)
print(json.dumps(out))
"""


def test_shared_textworld_parses_leave_games_unchanged():
    """The reuse of PDDL translations and grammar parses (a speed-up) must not change any text."""
    import subprocess
    import sys

    def transcript(mode: str) -> list:
        import json

        done = subprocess.run([sys.executable, "-c", _TRANSCRIPT_SCRIPT, mode], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    shared, plain = transcript("shared"), transcript("plain")
    assert len(shared) == 3 and all(len(lines) > 6 for lines in shared)
    assert shared == plain
