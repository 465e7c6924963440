import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qevolve.buffer.store import (
    SCHEMA_KEY, Episode, StoreError, Turn, read_episodes, read_metadata, settle_final_reward, summarize,
    write_episodes, write_shard,
)
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


def test_rejects_other_schema_version(tmp_path):
    path = write_episodes(tmp_path / "a.parquet", [make_episode(0)])
    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    meta[SCHEMA_KEY] = b"99"
    pq.write_table(table.replace_schema_metadata(meta), path)
    with pytest.raises(StoreError, match=r"a\.parquet: trajectory schema version 99, but this qevolve reads version 1"):
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
