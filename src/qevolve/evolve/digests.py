"""What a stage computed, as digests: weights by their tensors, trajectories by their content.

A stage's folder is summarised as ``{relative path: sha256}``:

* ``*.safetensors``: the file's bytes (the header lists names, dtypes and shapes; nothing volatile);
* ``*.pt`` (critic heads, trainer states): every tensor in the saved object with its key path, so the
  absolute paths and histories saved beside them do not count;
* a trajectory store (a ``*.parquet`` file, or a folder of ``part-*.parquet`` shards as one entry):
  :func:`qevolve.buffer.store.content_digest`, which leaves out wall times, file metadata, shard
  boundaries and file order.

Everything else (configs, metrics with wall times, tokenizer copies, logs) is not a result and is
left out. Two runs whose stages have equal digests trained the same weights on the same data.
:func:`compare_runs` is ``qevolve diff``: each stage equal or different, and for the first
trajectory store that differs, the first episode and turn where it does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

from qevolve.buffer.store import episode_record, read_episodes, sorted_episodes, store_digest

__all__ = ["differing_fields", "output_digests", "tensor_digest", "compare_runs", "first_episode_difference", "render_diff"]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _tensors(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _tensors(value[key], f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}[{index}]")


def tensor_digest(path: Path) -> str:
    """sha256 over every tensor of a ``torch.save`` file (key path, dtype, shape, bytes).

    Loaded with ``weights_only=True``: a digest never runs code from a run folder."""
    import torch

    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - not loadable as plain tensors and containers: its bytes stand for it
        return "file:" + _file_sha256(path)
    digest = hashlib.sha256()
    for name, tensor in _tensors(saved):
        tensor = tensor.detach().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def output_digests(folder: str | Path) -> dict[str, str]:
    """``{path relative to folder: sha256}`` of the results in ``folder`` (see the module docs).

    Hidden files and folders (staging leftovers, caches) are left out."""
    folder = Path(folder)
    result: dict[str, str] = {}
    if not folder.exists():
        return result
    files = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file())
    base = folder.parent if folder.is_file() else folder
    shard_folders: set[Path] = set()
    for path in files:
        rel = path.relative_to(base)
        if any(part.startswith(".") for part in rel.parts):
            continue
        if path.suffix == ".safetensors":
            result[str(rel)] = _file_sha256(path)
        elif path.suffix == ".pt":
            result[str(rel)] = tensor_digest(path)
        elif path.suffix == ".parquet":
            if path.name.startswith("part-"):
                shard_folders.add(path.parent)
            else:
                result[str(rel)] = store_digest(path)
    for shards in sorted(shard_folders):
        rel = shards.relative_to(base)
        result[str(rel)] = store_digest(shards)
    return dict(sorted(result.items()))


# ------------------------------------------------------------------------------------------- qevolve diff


def differing_fields(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Every dotted field where two JSON trees differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if key not in old or key not in new:
                out.append(dotted)
            else:
                out.extend(differing_fields(old[key], new[key], dotted))
        return out
    return [] if old == new else [prefix or "<root>"]


def _at(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part, "<missing>") if isinstance(tree, dict) else "<missing>"
    return tree


def _short(value: Any, width: int = 48) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[: width - 3] + "..."


def first_episode_difference(a: str | Path, b: str | Path) -> str | None:
    """Where two trajectory stores first differ: the episode (in id order), the turn and the field."""
    left, right = sorted_episodes(read_episodes(a)), sorted_episodes(read_episodes(b))
    for index, (x, y) in enumerate(zip(left, right)):
        rx, ry = episode_record(x), episode_record(y)
        if rx == ry:
            continue
        if x.episode_id != y.episode_id:
            return f"episode #{index}: {x.episode_id!r} in one, {y.episode_id!r} in the other"
        for turn, (tx, ty) in enumerate(zip(rx["turns"], ry["turns"])):
            if tx != ty:
                field = next(key for key in tx if tx[key] != ty.get(key))
                return (f"episode {x.episode_id!r} turn {turn}: {field} {_short(tx[field])} vs "
                        f"{_short(ty.get(field))}")
        if len(rx["turns"]) != len(ry["turns"]):
            return f"episode {x.episode_id!r}: {len(rx['turns'])} turns vs {len(ry['turns'])}"
        field = next(key for key in rx if key != "turns" and rx[key] != ry[key])
        return f"episode {x.episode_id!r}: {field} {_short(rx[field])} vs {_short(ry[field])}"
    if len(left) != len(right):
        return f"{len(left)} episodes vs {len(right)}"
    return None


def _manifest(root: Path) -> dict[str, Any]:
    from qevolve.evolve.run_dir import MANIFEST, RunDirectory

    path = root / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no run manifest (expected a run directory, runs/NAME)")
    return RunDirectory._read_manifest(path)


def compare_runs(a: str | Path, b: str | Path) -> dict[str, Any]:
    """``qevolve diff``: configs, environments and every stage of two runs."""
    from qevolve.config import strip_derived
    from qevolve.evolve.loop import EvolveConfig
    from qevolve.evolve.run_dir import LOCATION_FIELDS

    a, b = Path(a), Path(b)
    ma, mb = _manifest(a), _manifest(b)
    # older runs recorded the fields the loop decides itself too; they are not what the stages used
    config_a = {k: v for k, v in strip_derived(EvolveConfig, ma["config"]).items() if k not in LOCATION_FIELDS}
    config_b = {k: v for k, v in strip_derived(EvolveConfig, mb["config"]).items() if k not in LOCATION_FIELDS}
    config = [{"field": f, "a": _at(config_a, f), "b": _at(config_b, f)} for f in differing_fields(config_a, config_b)]
    env_a, env_b = ma.get("environment", {}), mb.get("environment", {})
    environment = [{"field": f, "a": _at(env_a, f), "b": _at(env_b, f)} for f in differing_fields(env_a, env_b)]
    stages_a = {s["name"]: s for s in ma["stages"]}
    stages_b = {s["name"]: s for s in mb["stages"]}
    names = [s["name"] for s in ma["stages"]] + [s["name"] for s in mb["stages"] if s["name"] not in stages_a]
    rows, first_trajectory = [], None
    for name in names:
        if name not in stages_a or name not in stages_b:
            rows.append({"stage": name, "status": f"only in {'a' if name in stages_a else 'b'}", "detail": ""})
            continue
        da, db = stages_a[name].get("digests"), stages_b[name].get("digests")
        if da is None or db is None:
            rows.append({"stage": name, "status": "no digests", "detail": "recorded before stage digests existed"})
            continue
        differing = [path for path in sorted(set(da) | set(db)) if da.get(path) != db.get(path)]
        metrics = differing_fields(stages_a[name]["metrics"], stages_b[name]["metrics"])
        if not differing and not metrics:
            rows.append({"stage": name, "status": "equal", "detail": f"{len(da)} digests"})
            continue
        detail = []
        if differing:
            detail.append("outputs differ: " + ", ".join(differing[:4]) + (" ..." if len(differing) > 4 else ""))
        if metrics:
            detail.append("metrics differ: " + ", ".join(metrics[:4]) + (" ..." if len(metrics) > 4 else ""))
        row = {"stage": name, "status": "different", "detail": "; ".join(detail)}
        stores = [path for path in differing if path in da and path in db and
                  (path.endswith(".parquet") or not Path(path).suffix)]
        if stores and first_trajectory is None:
            path = stores[0]
            where = first_episode_difference(a / name / path, b / name / path)
            first_trajectory = {"stage": name, "file": path, "where": where}
            row["detail"] += f"; first difference: {where}"
        rows.append(row)
    return {"a": str(a), "b": str(b), "config": config, "environment": environment, "stages": rows,
            "first_trajectory_difference": first_trajectory,
            "equal": not config and all(r["status"] == "equal" for r in rows)}


def render_diff(result: dict[str, Any]) -> str:
    lines = [f"a: {result['a']}", f"b: {result['b']}", ""]
    if result["config"]:
        lines.append("config differs:")
        lines += [f"  {row['field']}: {_short(row['a'])} vs {_short(row['b'])}" for row in result["config"]]
    else:
        lines.append("config: equal")
    if result["environment"]:
        lines.append("environment differs (results may then differ too):")
        lines += [f"  {row['field']}: {_short(row['a'])} vs {_short(row['b'])}" for row in result["environment"]]
    else:
        lines.append("environment: equal")
    lines.append("")
    width = max([len(row["stage"]) for row in result["stages"]] + [5])
    for row in result["stages"]:
        lines.append(f"{row['stage'].ljust(width)}  {row['status']:<9}  {row['detail']}".rstrip())
    lines.append("")
    lines.append("every stage equal" if result["equal"] else "the runs differ")
    return "\n".join(lines)
