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
:mod:`qevolve.evolve.diff` (``qevolve diff``) compares two runs with them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

from qevolve.buffer.store import episode_record, read_episodes, sorted_episodes, store_digest

__all__ = ["differing_fields", "output_digests", "tensor_digest", "first_episode_difference"]


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


def short_repr(value: Any, width: int = 48) -> str:
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
                return (f"episode {x.episode_id!r} turn {turn}: {field} {short_repr(tx[field])} vs "
                        f"{short_repr(ty.get(field))}")
        if len(rx["turns"]) != len(ry["turns"]):
            return f"episode {x.episode_id!r}: {len(rx['turns'])} turns vs {len(ry['turns'])}"
        field = next(key for key in rx if key != "turns" and rx[key] != ry[key])
        return f"episode {x.episode_id!r}: {field} {short_repr(rx[field])} vs {short_repr(ry[field])}"
    if len(left) != len(right):
        return f"{len(left)} episodes vs {len(right)}"
    return None
