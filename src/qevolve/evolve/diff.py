"""``qevolve diff``: two runs compared stage by stage, by the digests of what each stage wrote
(:mod:`qevolve.evolve.digests`): each stage equal or different, the config and environment fields that
differ, and for the first trajectory store that differs, the first episode and turn where it does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qevolve.config import strip_derived
from qevolve.config import value_at
from qevolve.evolve.digests import differing_fields, first_episode_difference, short_repr
from qevolve.evolve.loop import EvolveConfig
from qevolve.evolve.run_dir import LOCATION_FIELDS, MANIFEST, RunDirectory

__all__ = ["compare_runs", "render_diff"]


def _manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no run manifest (expected a run directory, runs/NAME)")
    return RunDirectory._read_manifest(path)


def compare_runs(a: str | Path, b: str | Path) -> dict[str, Any]:
    """``qevolve diff``: configs, environments and every stage of two runs."""
    a, b = Path(a), Path(b)
    ma, mb = _manifest(a), _manifest(b)
    # older runs recorded the fields the loop decides itself too; they are not what the stages used
    config_a = {k: v for k, v in strip_derived(EvolveConfig, ma["config"]).items() if k not in LOCATION_FIELDS}
    config_b = {k: v for k, v in strip_derived(EvolveConfig, mb["config"]).items() if k not in LOCATION_FIELDS}
    config = [{"field": f, "a": value_at(config_a, f), "b": value_at(config_b, f)} for f in differing_fields(config_a, config_b)]
    env_a, env_b = ma.get("environment", {}), mb.get("environment", {})
    environment = [{"field": f, "a": value_at(env_a, f), "b": value_at(env_b, f)} for f in differing_fields(env_a, env_b)]
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
        lines += [f"  {row['field']}: {short_repr(row['a'])} vs {short_repr(row['b'])}" for row in result["config"]]
    else:
        lines.append("config: equal")
    if result["environment"]:
        lines.append("environment differs (results may then differ too):")
        lines += [f"  {row['field']}: {short_repr(row['a'])} vs {short_repr(row['b'])}" for row in result["environment"]]
    else:
        lines.append("environment: equal")
    lines.append("")
    width = max([len(row["stage"]) for row in result["stages"]] + [5])
    for row in result["stages"]:
        lines.append(f"{row['stage'].ljust(width)}  {row['status']:<9}  {row['detail']}".rstrip())
    lines.append("")
    lines.append("every stage equal" if result["equal"] else "the runs differ")
    return "\n".join(lines)
