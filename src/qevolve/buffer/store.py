"""The trajectory store: a versioned Parquet format, one row per agent turn.

A store is a Parquet file, or a folder of Parquet shards (``part-*.parquet``) read in name order,
so long jobs can write shard by shard and resume. Episode-level fields are repeated on every row of
the episode (Parquet's dictionary encoding makes that nearly free); rows of one episode are
contiguous and ordered by ``turn_index``. Any tool that reads Parquet (pandas, polars, DuckDB)
reads it as a flat table.

Token-in-token-out: for turn t, ``context_ids`` are the tokens appended to the conversation before
the agent's turn (for t = 0 the system prompt, instruction and first observation; later the
observation message), and ``action_ids`` are the agent's own tokens. Concatenating
``context_ids + action_ids`` over the turns gives the whole conversation once, with every action
span known, so later stages never re-tokenise decoded text.

Failed episodes (a worker died, an environment step timed out) are stored too, with
``failed = True`` and the reason in ``failure_reason``, holding the turns played before the
failure; one that failed before its first turn is a single row whose turn columns are null
(``turn_index`` null). Training stages leave them out by rule (:func:`usable_episodes`).

Every reward and label (``reward``, ``score``, ``r_aux``, ``value``, ``q_value``, ``advantage``)
must be a finite number: a store holding NaN or infinity is refused when written and when read,
naming the file, episode and turn.

Schema versions: 2 added ``failed`` and ``failure_reason``; version 1 files are still read (as
episodes that did not fail).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from qevolve.atomic_io import atomic_write

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 lacks the failed/failure_reason columns
SCHEMA_KEY = b"qevolve.trajectory_schema_version"
META_KEY = b"qevolve.metadata"


class StoreError(ValueError):
    """A trajectory file that cannot be read: wrong schema version, not a store, missing."""


@dataclass
class Turn:
    """One agent turn: what it saw, what it wrote, what the environment answered, later labels."""

    observation: str  # o_t: the observation the agent acted on
    agent_text: str  # the raw text of the agent's turn (thought + action)
    action: str | None  # the parsed action; None when the turn did not parse (format error)
    format_valid: bool = True
    action_valid: bool = True  # False when the environment rejected the action (e.g. "Nothing happens.")
    reward: float = 0.0  # r_env received after this action
    done: bool = False
    context_ids: list[int] | None = None
    action_ids: list[int] | None = None
    action_logprobs: list[float] | None = None  # per action token, under the acting policy
    r_aux: float | None = None  # retrospective penalty (critic labels)
    value: float | None = None  # V(s_t)
    q_value: float | None = None  # Q(s_t, a_t)
    advantage: float | None = None  # process reward used by the policy update
    generation_seconds: float | None = None
    env_seconds: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """One trajectory with its provenance."""

    episode_id: str
    task_id: str
    env: str
    split: str
    source: str  # "expert", "synthetic" (scripted oracle), "self" (policy rollouts), ...
    turns: list[Turn] = field(default_factory=list)
    won: bool = False
    score: float = 0.0  # final environment reward of the episode
    final_observation: str = ""  # o_T, the observation after the last action
    meta: dict[str, Any] = field(default_factory=dict)
    failed: bool = False  # lost to an environment failure (worker death, timeout); turns are those played
    failure_reason: str | None = None  # why it failed (None unless failed)

    def next_observation(self, t: int) -> str:
        """o_{t+1}: the observation that answered turn t."""
        return self.turns[t + 1].observation if t + 1 < len(self.turns) else self.final_observation

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def ended_with_reward(self) -> bool:
        """d of the critic's weights w_t (method section 4): the episode ended with a non-zero final
        environment reward, i.e. its final ``score`` is > 0 (scores lie in [0, 1]). Read from the
        episode's final score, not from the sign of its last turn's reward."""
        return self.score > 0


def settle_final_reward(episode: Episode) -> None:
    """Put the episode's final reward on its last turn when the runner ended it (not ``done``).

    r_env is sparse: an environment gives the final reward on the step that ends the episode. An
    episode cut at the turn limit (or stopped by its policy) never saw that step, so its last turn
    gets what its final ``score`` adds to the rewards already given (for a sparse environment: the
    score itself). The rewards of every recorded episode then sum to its ``score``.
    """
    if episode.turns and not episode.turns[-1].done:
        episode.turns[-1].reward += episode.score - sum(turn.reward for turn in episode.turns)


_EPISODE_FIELDS = [f.name for f in fields(Episode) if f.name != "turns"]
_TURN_FIELDS = [f.name for f in fields(Turn)]

ARROW_SCHEMA = pa.schema([
    ("episode_id", pa.string()),
    ("task_id", pa.string()),
    ("env", pa.string()),
    ("split", pa.string()),
    ("source", pa.string()),
    ("won", pa.bool_()),
    ("score", pa.float64()),
    ("final_observation", pa.string()),
    ("meta", pa.string()),  # JSON
    ("failed", pa.bool_()),
    ("failure_reason", pa.string()),
    ("turn_index", pa.int32()),  # null on the single row of a failed episode without turns
    ("observation", pa.string()),
    ("agent_text", pa.string()),
    ("action", pa.string()),
    ("format_valid", pa.bool_()),
    ("action_valid", pa.bool_()),
    ("reward", pa.float64()),
    ("done", pa.bool_()),
    ("context_ids", pa.list_(pa.int32())),
    ("action_ids", pa.list_(pa.int32())),
    ("action_logprobs", pa.list_(pa.float32())),
    ("r_aux", pa.float64()),
    ("value", pa.float64()),
    ("q_value", pa.float64()),
    ("advantage", pa.float64()),
    ("generation_seconds", pa.float64()),
    ("env_seconds", pa.float64()),
    ("info", pa.string()),  # JSON
])


#: float columns that must hold finite numbers (null allowed where the field is optional)
FINITE_COLUMNS = ("reward", "score", "r_aux", "value", "q_value", "advantage")


def check_finite(table: pa.Table, source: str) -> None:
    """Refuse NaN or infinite rewards and labels, naming ``source``, the episode, the turn and the column."""
    for name in FINITE_COLUMNS:
        column = table.column(name)
        bad = pc.invert(pc.fill_null(pc.is_finite(column), True))
        if not pc.any(bad).as_py():
            continue
        row = pc.index(bad, True).as_py()
        episode = table.column("episode_id")[row].as_py()
        turn = table.column("turn_index")[row].as_py()
        value = column[row].as_py()
        where = f"episode {episode!r}" if name == "score" else f"episode {episode!r} turn {turn}"
        raise StoreError(f"{source}: {where}: {name} is {value}; expected a finite number")


def _empty_turn_values() -> dict[str, Any]:
    return {"turn_index": None, **{name: None for name in _TURN_FIELDS}}


def episodes_to_table(episodes: Iterable[Episode], source: str = "episodes") -> pa.Table:
    columns: dict[str, list[Any]] = {name: [] for name in ARROW_SCHEMA.names}
    for ep in episodes:
        if not ep.turns and not ep.failed:
            raise StoreError(f"episode {ep.episode_id!r} has no turns; the store keeps one row per turn "
                             f"(only a failed episode may have none)")
        ep_values = {name: getattr(ep, name) for name in _EPISODE_FIELDS}
        ep_values["meta"] = json.dumps(ep.meta, sort_keys=True)
        if not ep.turns:  # a failed episode that never played a turn: one row, turn columns null
            for name, value in {**ep_values, **_empty_turn_values()}.items():
                columns[name].append(value)
            continue
        for t, turn in enumerate(ep.turns):
            for name, value in ep_values.items():
                columns[name].append(value)
            columns["turn_index"].append(t)
            for name in _TURN_FIELDS:
                value = getattr(turn, name)
                columns[name].append(json.dumps(value, sort_keys=True) if name == "info" else value)
    table = pa.Table.from_pydict(columns, schema=ARROW_SCHEMA)
    check_finite(table, source)
    return table


def table_to_episodes(table: pa.Table) -> list[Episode]:
    data = table.to_pydict()
    n = table.num_rows
    episodes: list[Episode] = []
    current: Episode | None = None
    for i in range(n):
        turn_index = data["turn_index"][i]
        if turn_index is None or turn_index == 0:
            current = Episode(**{name: data[name][i] for name in _EPISODE_FIELDS})
            current.meta = json.loads(current.meta) if current.meta else {}
            current.failed = bool(current.failed)
            episodes.append(current)
            if turn_index is None:
                if not current.failed:
                    raise StoreError(f"row {i}: episode {current.episode_id!r} has no turns but is not failed")
                current = None
                continue
        elif current is None or data["episode_id"][i] != current.episode_id or turn_index != current.num_turns:
            raise StoreError(f"row {i}: turn {turn_index} of episode {data['episode_id'][i]!r} is out of order")
        turn_values = {name: data[name][i] for name in _TURN_FIELDS}
        turn_values["info"] = json.loads(turn_values["info"]) if turn_values["info"] else {}
        current.turns.append(Turn(**turn_values))
    return episodes


def usable_episodes(episodes: Iterable[Episode], include_failed: bool = False) -> list[Episode]:
    """The episodes a training stage may learn from: the rule that keeps failed episodes out.

    Failed episodes (environment failures, see :class:`Episode`) are left out unless
    ``include_failed``; episodes without turns are always left out (nothing to learn from).
    """
    return [ep for ep in episodes if ep.turns and (include_failed or not ep.failed)]


def episodes_of_sources(episodes: list[Episode], sources: list[str] | None, where: str) -> list[Episode]:
    """The episodes whose ``source`` is one of ``sources`` (None: all of them). Naming sources that no episode
    has is an error naming the ones there are (``where``: the store, for the message): a stage that trains
    on nothing is a mistake, e.g. ``[expert]`` on a buffer whose demonstrations are ``synthetic``."""
    if sources is None:
        return episodes
    kept = [ep for ep in episodes if ep.source in set(sources)]
    if not kept and episodes:
        counts: dict[str, int] = {}
        for ep in episodes:
            counts[ep.source] = counts.get(ep.source, 0) + 1
        there = ", ".join(f"{source} ({count} episodes)" for source, count in sorted(counts.items()))
        raise ValueError(f"only_sources {sorted(sources)}: no episode of {where} has these sources; its sources "
                         f"are {there}")
    return kept


def _atomic_write_table(table: pa.Table, path: Path, metadata: dict[str, Any] | None) -> None:
    schema_meta = {SCHEMA_KEY: str(SCHEMA_VERSION).encode(), META_KEY: json.dumps(metadata or {}).encode()}
    table = table.replace_schema_metadata(schema_meta)
    atomic_write(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def write_episodes(path: str | Path, episodes: Iterable[Episode], metadata: dict[str, Any] | None = None) -> Path:
    """Write episodes to one Parquet file atomically (temp file + rename)."""
    path = Path(path)
    _atomic_write_table(episodes_to_table(episodes, str(path)), path, metadata)
    return path


def shard_paths(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("part-*.parquet"))


def write_shard(folder: str | Path, index: int, episodes: Iterable[Episode],
                metadata: dict[str, Any] | None = None) -> Path:
    """Write one shard ``part-{index:05d}.parquet`` of a sharded store."""
    return write_episodes(Path(folder) / f"part-{index:05d}.parquet", episodes, metadata)


def _check_file(path: Path) -> pq.ParquetFile:
    try:
        handle = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise StoreError(f"{path}: not a Parquet trajectory file ({err})") from None
    meta = handle.schema_arrow.metadata or {}
    if SCHEMA_KEY not in meta:
        raise StoreError(f"{path}: not a qevolve trajectory file (no {SCHEMA_KEY.decode()} in its metadata)")
    version = int(meta[SCHEMA_KEY])
    if version not in READABLE_VERSIONS:
        raise StoreError(
            f"{path}: trajectory schema version {version}, but this qevolve reads version {SCHEMA_VERSION} "
            f"(and the older {', '.join(str(v) for v in READABLE_VERSIONS if v != SCHEMA_VERSION)})"
        )
    return handle


def _read_file(path: Path) -> pa.Table:
    """One file as a table of the current schema (a version 1 file gains failed=false columns)."""
    handle = _check_file(path)
    version = int((handle.schema_arrow.metadata or {})[SCHEMA_KEY])
    if version == 1:
        table = handle.read()
        table = table.append_column("failed", pa.array([False] * table.num_rows, pa.bool_()))
        table = table.append_column("failure_reason", pa.nulls(table.num_rows, pa.string()))
        table = table.select(ARROW_SCHEMA.names).cast(ARROW_SCHEMA)
    else:
        table = pq.read_table(path, schema=ARROW_SCHEMA)
    check_finite(table, str(path))
    return table


def read_metadata(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    files = (shard_paths(path) or _single_parquet(path)) if path.is_dir() else [path]
    if not files:
        return {}
    meta = _check_file(files[0]).schema_arrow.metadata or {}
    return json.loads(meta.get(META_KEY, b"{}"))


def _single_parquet(folder: Path) -> list[Path]:
    """The one ``.parquet`` file of a folder without shards (a run's stage folder, e.g. ``iter_1/label``
    holding ``labelled.parquet``), so the folder a run names can be read as it is; none when there are
    none or several (which one would be a guess)."""
    files = sorted(folder.glob("*.parquet"))
    return files if len(files) == 1 else []


def iter_files(path: str | Path) -> list[Path]:
    """The files of a store: a file; a folder of ``part-*.parquet`` shards; a folder holding exactly one
    ``.parquet`` file (a run's stage folder such as ``runs/NAME/iter_1/label``)."""
    path = Path(path)
    if path.is_dir():
        files = shard_paths(path) or _single_parquet(path)
        if not files:
            several = sorted(p.name for p in path.glob("*.parquet"))
            if several:
                raise StoreError(f"{path}: folder holds no part-*.parquet shards but several .parquet files "
                                 f"({', '.join(several)}); name one")
            inner = path / "trajectories"  # an evaluation stage's folder
            hint = f"; did you mean {str(inner)!r}?" if inner.is_dir() and shard_paths(inner) else ""
            raise StoreError(f"{path}: folder holds no part-*.parquet shards and no .parquet file{hint}")
        return files
    if not path.exists():
        raise StoreError(f"{path}: trajectory file not found")
    return [path]


def read_table(path: str | Path) -> pa.Table:
    tables = [_read_file(file) for file in iter_files(path)]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def read_episodes(path: str | Path) -> list[Episode]:
    """Read every episode of a store (file or sharded folder)."""
    return table_to_episodes(read_table(path))


def iter_episodes(path: str | Path) -> Iterator[Episode]:
    for file in iter_files(path):
        yield from read_episodes(file)


def episode_as_dict(ep: Episode) -> dict[str, Any]:
    return asdict(ep)


# ------------------------------------------------------------------------------------------ content digests

#: fields that measure how long something took, not what it was: left out of content digests
TIMING_TURN_FIELDS = ("generation_seconds", "env_seconds")


def _is_timing_key(key: str) -> bool:
    return "second" in key or key.endswith("_time") or key in ("elapsed", "date")


def episode_record(ep: Episode) -> dict[str, Any]:
    """An episode as plain data without timing fields: what it *is*, for digests and ``qevolve diff``.

    Floats stay exact (JSON writes the shortest repr that reads back bit for bit)."""
    record = {name: getattr(ep, name) for name in _EPISODE_FIELDS}
    record["meta"] = {k: v for k, v in ep.meta.items() if not _is_timing_key(k)}
    turns = []
    for turn in ep.turns:
        values = {name: getattr(turn, name) for name in _TURN_FIELDS if name not in TIMING_TURN_FIELDS}
        values["info"] = {k: v for k, v in turn.info.items() if not _is_timing_key(k)}
        turns.append(values)
    record["turns"] = turns
    return record


def sorted_episodes(episodes: Iterable[Episode]) -> list[Episode]:
    """Episodes in the stable order every reader uses before a seeded choice: by episode id (ids are
    unique in a store; ties, e.g. two stores merged, keep their input order)."""
    return sorted(episodes, key=lambda ep: ep.episode_id)


def content_digest(episodes: Iterable[Episode]) -> str:
    """sha256 of the episodes' content in episode-id order: equal for two stores that hold the same
    episodes, whatever their file order, shard boundaries, metadata or wall times."""
    import hashlib

    digest = hashlib.sha256()
    for ep in sorted_episodes(episodes):
        digest.update(json.dumps(episode_record(ep), sort_keys=True, separators=(",", ":")).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def store_digest(path: str | Path) -> str:
    """:func:`content_digest` of a trajectory file or sharded folder."""
    return content_digest(read_episodes(path))
