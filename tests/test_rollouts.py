"""The agent loop with a tiny random policy on real ALFWorld games."""

import pytest
import torch

from qevolve.buffer.store import StoreError, read_episodes
from qevolve.environments.play import list_tasks
from qevolve.models.loading import ModelConfig, load_policy
from qevolve.prompting import PromptBuilder, PromptConfig, episode_segments
from qevolve.rollouts.agent import AgentConfig, expand_jobs, run_agent
from qevolve.rollouts.generation import HFGenerationBackend
from qevolve.rollouts.run import RolloutConfig, run_eval

pytestmark = pytest.mark.usefixtures("alfworld_installed")


@pytest.fixture(scope="module")
def tiny_policy(tiny_model_dir):
    return load_policy(ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu"), trainable=False)


def play(policy, tasks, batch_size, reuse_cache, max_turns=3, **agent_kwargs):
    prompt = PromptConfig(max_prompt_tokens=1024, reserve_action_tokens=16)
    builder = PromptBuilder.for_environment(policy.tokenizer, prompt, "alfworld")
    backend = HFGenerationBackend(policy.model, builder.formatter.eot_ids[-1:], policy.tokenizer.pad_token_id,
                                  reuse_cache=reuse_cache)
    config = AgentConfig(batch_size=batch_size, num_workers=2, max_new_tokens=12, max_turns=max_turns,
                         reuse_cache=reuse_cache, **agent_kwargs)
    jobs = expand_jobs("alfworld", "seen", tasks, 1)
    return run_agent("alfworld", "seen", jobs, backend, builder, policy.tokenizer, config, progress=False), builder


def test_token_ids_decode_to_text_and_logprobs_match_a_fresh_pass(tiny_policy):
    tasks = list_tasks("alfworld", "seen")[:2]
    result, builder = play(tiny_policy, tasks, batch_size=2, reuse_cache=True)
    assert not result.failed and len(result.episodes) == 2
    eot = builder.formatter.eot_ids
    for episode in result.episodes:
        assert episode.num_turns == 3
        for turn in episode.turns:
            ids = turn.action_ids[:-len(eot)] if turn.action_ids[-len(eot):] == eot else turn.action_ids
            assert tiny_policy.tokenizer.decode(ids, skip_special_tokens=False) == turn.agent_text
            assert len(turn.action_logprobs) == len(turn.action_ids)
        # Re-tokenising the stored episode with the same builder gives back the acting-time ids.
        again = builder.tokenize(episode)
        assert [t.context_ids for t in again.turns] == [t.context_ids for t in episode.turns]
        # The recorded log-probs equal one plain forward pass over the whole conversation.
        (segment,) = episode_segments(episode)
        ids = torch.tensor([segment.trajectory.input_ids])
        with torch.no_grad():
            logp = torch.log_softmax(tiny_policy.model(input_ids=ids).logits[0].float(), -1)
        for turn, (start, end) in zip(episode.turns, segment.trajectory.action_spans):
            fresh = [float(logp[i - 1, ids[0, i]]) for i in range(start, end)]
            assert turn.action_logprobs == pytest.approx(fresh, abs=2e-4)


def test_batched_and_one_at_a_time_rollouts_take_the_same_actions(tiny_policy):
    tasks = list_tasks("alfworld", "seen")[:4]
    batched, _ = play(tiny_policy, tasks, batch_size=4, reuse_cache=True)
    single, _ = play(tiny_policy, tasks, batch_size=1, reuse_cache=False)
    by_id = {ep.episode_id: ep for ep in single.episodes}
    for episode in batched.episodes:
        other = by_id[episode.episode_id]
        assert [t.action_ids for t in episode.turns] == [t.action_ids for t in other.turns]
        assert [t.agent_text for t in episode.turns] == [t.agent_text for t in other.turns]


def test_format_errors_are_recorded_and_the_episode_goes_on(tiny_policy):
    (task,) = list_tasks("alfworld", "seen")[:1]
    result, _ = play(tiny_policy, [task], batch_size=1, reuse_cache=True, max_turns=3)
    (episode,) = result.episodes
    # A random tiny model never writes "Action: ...": every turn is a format error, and the
    # environment is not stepped, yet the episode runs to its turn limit.
    assert episode.num_turns == 3
    assert all(not t.format_valid and t.action is None for t in episode.turns)
    assert all(t.info["env_stepped"] is False for t in episode.turns)
    assert episode.turns[1].observation.startswith("Your reply was not in the required format")
    noop, _ = play(tiny_policy, [task], batch_size=1, reuse_cache=True, max_turns=2, format_error_policy="noop")
    assert all(t.info.get("env_stepped", True) for t in noop.episodes[0].turns)


def test_an_episode_cut_at_the_turn_limit_gets_its_score_on_the_last_turn(tiny_policy):
    """Sparse r_env: the runner puts a truncated episode's final score (progress 2/5) on its last turn."""
    prompt = PromptConfig(max_prompt_tokens=1024, reserve_action_tokens=16)
    builder = PromptBuilder.for_environment(tiny_policy.tokenizer, prompt, "alfworld")
    backend = HFGenerationBackend(tiny_policy.model, builder.formatter.eot_ids[-1:], tiny_policy.tokenizer.pad_token_id)
    # the random tiny model never writes an action: its turns are format errors, executed as "next"
    config = AgentConfig(batch_size=1, num_workers=1, max_new_tokens=4, max_turns=2, format_error_policy="noop",
                         noop_action="next")
    result = run_agent("qevolve.environments.testing:CounterEnv", "train", [("c#0", "count-5")], backend, builder,
                       tiny_policy.tokenizer, config, progress=False, env_kwargs={"partial_score": True})
    (episode,) = result.episodes
    assert episode.num_turns == 2 and not episode.turns[-1].done and not episode.won
    assert episode.score == pytest.approx(0.4) and [t.reward for t in episode.turns] == [0.0, episode.score]
    assert episode.ended_with_reward


def test_eval_writes_trajectories_and_metrics(tiny_model_dir, tmp_path):
    config = RolloutConfig(env="alfworld", split="unseen", limit=2, task_stride=10,
                           model=ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu"),
                           prompt=PromptConfig(max_prompt_tokens=1024, reserve_action_tokens=16),
                           agent=AgentConfig(batch_size=2, max_new_tokens=8, max_turns=2), source="eval")
    metrics = run_eval(config, tmp_path, progress=False)
    assert metrics["episodes"] == 2 and metrics["success_rate"] == 0.0 and metrics["format_error_rate"] == 1.0
    assert metrics["protocol"]["split"] == "unseen"
    # the first turn encodes the whole prompt, the second (the cache reused) only its new tokens
    first_prompts = sum(len(ep.turns[0].context_ids) for ep in read_episodes(tmp_path / "trajectories"))
    assert first_prompts < metrics["prompt_tokens_encoded_this_run"] < 2 * first_prompts
    assert metrics["cache_rebuilds_this_run"] >= 1
    episodes = read_episodes(tmp_path / "trajectories")
    assert sorted(ep.task_id for ep in episodes) == sorted(list_tasks("alfworld", "unseen")[::10][:2])
    turns = [t for ep in episodes for t in ep.turns]  # the record survives storage; cut turns have 8 tokens
    cut = [t for t in turns if t.info.get("truncated_generation")]
    assert metrics["truncated_turn_rate"] == pytest.approx(len(cut) / len(turns))
    assert cut and all(len(t.action_ids) == 8 for t in cut)
    # A second run resumes: nothing left to play, same trajectories.
    again = run_eval(config, tmp_path, progress=False)
    assert again["episodes"] == 2 and len(read_episodes(tmp_path / "trajectories")) == 2
    # The folder is refused to any other evaluation, whose metrics would count these episodes.
    for change, named in (({"split": "seen"}, "split 'unseen'"), ({"limit": 1}, "would not play"),
                          ({"model": config.model.model_copy(update={"name_or_path": str(tmp_path / "other")})},
                           "checkpoint")):
        with pytest.raises(StoreError, match=named):
            run_eval(config.model_copy(update=change), tmp_path, progress=False)
    assert len(read_episodes(tmp_path / "trajectories")) == 2


@pytest.mark.parametrize("env, split", [("webshop", "test"), ("sciworld", "unseen")])
def test_eval_accepts_the_other_environments(all_data_installed, tiny_model_dir, tmp_path, env, split):
    config = RolloutConfig(env=env, split=split, limit=1,
                           model=ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu"),
                           prompt=PromptConfig(max_prompt_tokens=2048, reserve_action_tokens=16),
                           agent=AgentConfig(batch_size=1, max_new_tokens=8, max_turns=2, num_workers=1))
    metrics = run_eval(config, tmp_path, progress=False)
    assert metrics["episodes"] == 1 and metrics["failed_episodes"] == 0
    (episode,) = read_episodes(tmp_path / "trajectories")
    assert episode.env == env and episode.num_turns == 2 and episode.turns[0].context_ids
