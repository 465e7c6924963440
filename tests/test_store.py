import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qevolve.buffer.store import (SCHEMA_KEY, Episode, StoreError, Turn, read_episodes, read_metadata,
                                  settle_final_reward, usable_episodes, write_episodes, write_shard)
from qevolve.buffer.metrics import summarize
from qevolve.buffer.tokenized import tokenized_from_episode


def make_episode(i: int, n_turns: int = 3, won: bool = True, tokens: bool = False) -> Episode:
    turns = []
    for t in range(n_turns):
        turns.append(Turn(
            observation=f"obs {i}.{t}", agent_text=f"Action: act {t}", action=f"act {t}",
            format_valid=t != 1, action_valid=t != 2, reward=1.0 if (won and t == n_turns - 1) else 0.0,
            done=won and t == n_turns - 1,
            context_ids=[1, 2, t] if tokens else None, action_ids=[10 + t, 11] if tokens else None,
            action_logprobs=[-0.5, -0.25] if tokens else None,
            r_aux=-0.1 if t else None, value=0.5 * t if tokens else None, info={"k": t},
        ))
    return Episode(f"ep{i}", f"task/{i}", "alfworld", "train", "expert", turns, won, 1.0 if won else 0.0,
                   final_observation="the end", meta={"seed": i})


def test_round_trip(tmp_path):
    episodes = [make_episode(i, n_turns=1 + i % 4, won=i % 2 == 0, tokens=i % 3 == 0) for i in range(10)]
    path = write_episodes(tmp_path / "buf.parquet", episodes, {"note": "x"})
    back = read_episodes(path)
    assert back == episodes
    assert read_metadata(path) == {"note": "x"}
    # Readable by standard tools as a flat table, one row per turn.
    table = pq.read_table(path)
    assert table.num_rows == sum(ep.num_turns for ep in episodes)
    assert json.loads(table.column("info")[0].as_py()) == {"k": 0}


def test_sharded_folder_and_summary(tmp_path):
    write_shard(tmp_path, 0, [make_episode(0), make_episode(1, won=False)])
    write_shard(tmp_path, 1, [make_episode(2)])
    back = read_episodes(tmp_path)
    assert [ep.episode_id for ep in back] == ["ep0", "ep1", "ep2"]
    summary = summarize(back)
    row = summary["groups"][0]
    assert summary["episodes"] == 3 and row["success_rate"] == pytest.approx(2 / 3)
    assert row["format_error_rate"] == pytest.approx(1 / 3)


def test_a_stage_folder_holding_one_parquet_file_reads_as_that_file(tmp_path):
    # a run's label stage: runs/NAME/iter_1/label holds labelled.parquet, not part-* shards
    stage = tmp_path / "label"
    write_episodes(stage / "labelled.parquet", [make_episode(0), make_episode(1)], {"kind": "labelled"})
    assert [ep.episode_id for ep in read_episodes(stage)] == ["ep0", "ep1"]
    assert read_metadata(stage)["kind"] == "labelled"
    # two files: which one is meant is not guessed
    write_episodes(stage / "other.parquet", [make_episode(2)])
    with pytest.raises(StoreError, match=r"label: folder holds no part-\*.parquet shards but several .parquet files "
                                         r"\(labelled.parquet, other.parquet\); name one"):
        read_episodes(stage)
    # an evaluation stage keeps its shards one folder down
    evaluation = tmp_path / "eval_test"
    write_shard(evaluation / "trajectories", 0, [make_episode(3)])
    with pytest.raises(StoreError, match=r"eval_test: folder holds no part-\*.parquet shards and no .parquet file; "
                                         r"did you mean '.*eval_test/trajectories'\?"):
        read_episodes(evaluation)


def test_rejects_other_schema_version(tmp_path):
    path = write_episodes(tmp_path / "a.parquet", [make_episode(0)])
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    meta[SCHEMA_KEY] = b"99"
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(StoreError, match=r"a\.parquet: trajectory schema version 99, but this qevolve reads version 2 \(and the older 1\)"):
        read_episodes(path)


def test_rejects_foreign_files(tmp_path):
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"x": [1]}), plain)
    with pytest.raises(StoreError, match="not a qevolve trajectory file"):
        read_episodes(plain)
    text = tmp_path / "text.parquet"
    text.write_text("hello")
    with pytest.raises(StoreError, match="not a Parquet trajectory file"):
        read_episodes(text)
    with pytest.raises(StoreError, match="not found"):
        read_episodes(tmp_path / "missing.parquet")


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    path = write_episodes(tmp_path / "b.parquet", [make_episode(0)])
    with pytest.raises(StoreError, match="no turns"):
        write_episodes(path, [Episode("e", "t", "alfworld", "train", "self")])
    assert read_episodes(path)[0].episode_id == "ep0"
    assert [p.name for p in tmp_path.iterdir()] == ["b.parquet"]


def test_tokenized_trajectory_spans():
    ep = make_episode(0, n_turns=3, tokens=True)
    traj = tokenized_from_episode(ep)
    assert traj.input_ids == [1, 2, 0, 10, 11, 1, 2, 1, 11, 11, 1, 2, 2, 12, 11]
    assert traj.action_spans == [(3, 5), (8, 10), (13, 15)]
    assert traj.value_positions == [2, 7, 12] and traj.q_positions == [4, 9, 14]
    assert sum(traj.action_mask()) == 6
    with pytest.raises(ValueError, match="no token ids"):
        tokenized_from_episode(make_episode(1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward_refused_on_write(tmp_path, bad):
    episodes = [make_episode(0), make_episode(1)]
    episodes[1].turns[2].reward = bad
    with pytest.raises(StoreError, match=rf"bad\.parquet: episode 'ep1' turn 2: reward is {bad}; expected a finite"):
        write_episodes(tmp_path / "bad.parquet", episodes)
    assert not list(tmp_path.iterdir())


def test_non_finite_values_refused_on_read(tmp_path):
    path = write_episodes(tmp_path / "a.parquet", [make_episode(0), make_episode(1)])
    table = pq.read_table(path)
    rewards = table.column("reward").to_pylist()
    rewards[4] = float("nan")  # episode ep1, turn 1
    table = table.set_column(table.schema.get_field_index("reward"), "reward", pa.array(rewards, pa.float64()))
    pq.write_table(table, path)  # keeps the schema metadata
    with pytest.raises(StoreError, match=r"a\.parquet: episode 'ep1' turn 1: reward is nan"):
        read_episodes(path)
    episodes = [make_episode(0)]
    episodes[0].turns[0].advantage = float("inf")
    with pytest.raises(StoreError, match=r"turn 0: advantage is inf"):
        write_episodes(tmp_path / "b.parquet", episodes)


def test_failed_episodes_are_stored_with_their_reason(tmp_path):
    partial = make_episode(1, n_turns=2, won=False)
    partial.failed, partial.failure_reason = True, "worker 123 died (exit code -9)"
    empty = Episode("ep2", "task/2", "alfworld", "train", "self", failed=True,
                    failure_reason="no answer within the step timeout (60 s)")
    episodes = [make_episode(0), partial, empty, make_episode(3)]
    path = write_episodes(tmp_path / "f.parquet", episodes)
    back = read_episodes(path)
    assert back == episodes
    assert [ep.failure_reason for ep in back] == [None, "worker 123 died (exit code -9)",
                                                  "no answer within the step timeout (60 s)", None]
    table = pq.read_table(path)
    assert table.num_rows == 3 + 2 + 1 + 3 and table.column("turn_index")[5].as_py() is None
    assert sum(row["failed"] for row in summarize(back)["groups"]) == 2
    # Training leaves them out by rule; include_failed keeps the partial one (the empty one has nothing).
    assert [ep.episode_id for ep in usable_episodes(back)] == ["ep0", "ep3"]
    assert [ep.episode_id for ep in usable_episodes(back, include_failed=True)] == ["ep0", "ep1", "ep3"]


def test_reads_schema_version_1(tmp_path):
    path = write_episodes(tmp_path / "v1.parquet", [make_episode(0), make_episode(1, won=False)])
    table = pq.read_table(path).drop_columns(["failed", "failure_reason"])
    meta = dict(table.schema.metadata)
    meta[SCHEMA_KEY] = b"1"
    pq.write_table(table.replace_schema_metadata(meta), path)
    back = read_episodes(path)
    assert [ep.episode_id for ep in back] == ["ep0", "ep1"] and not any(ep.failed for ep in back)
    assert back[0] == make_episode(0)


def test_settle_final_reward_puts_the_score_on_a_cut_episodes_last_turn():
    cut = make_episode(0, n_turns=3, won=False)
    cut.score = 0.43  # reached 43 before the turn limit; a sparse environment gave no reward yet
    settle_final_reward(cut)
    assert [t.reward for t in cut.turns] == [0.0, 0.0, 0.43] and cut.ended_with_reward
    done = make_episode(1, n_turns=2, won=True)  # ended by the environment: left as it is
    settle_final_reward(done)
    assert [t.reward for t in done.turns] == [0.0, 1.0] and done.ended_with_reward
    lost = make_episode(2, n_turns=2, won=False)
    settle_final_reward(lost)
    assert [t.reward for t in lost.turns] == [0.0, 0.0] and not lost.ended_with_reward


def test_only_sources_keeps_those_sources_and_names_the_buffers_sources_when_none_match():
    from dataclasses import replace

    from qevolve.buffer.store import episodes_of_sources

    episodes = [replace(make_episode(i), source=source) for i, source in enumerate(["self", "synthetic", "self"])]
    assert episodes_of_sources(episodes, None, "B") == episodes
    assert [ep.episode_id for ep in episodes_of_sources(episodes, ["self"], "B")] == \
        [episodes[0].episode_id, episodes[2].episode_id]
    with pytest.raises(ValueError, match=r"only_sources \['expert'\]: no episode of B has these sources; its "
                                         r"sources are self \(2 episodes\), synthetic \(1 episodes\)"):
        episodes_of_sources(episodes, ["expert"], "B")
