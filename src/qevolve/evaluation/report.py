"""``qevolve report runs/NAME``: one static HTML page for a run.

It shows the metrics of every evaluation stage per iteration as inline SVG line plots (no
JavaScript, no plotting dependency) and a browsable list of labelled trajectories: every turn
with its observation, action, r_env, r_aux, V, Q and process reward (advantage), the advantage
cell coloured from red (negative) to green (positive).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

from qevolve.buffer.store import Episode, read_episodes

PLOTTED_METRICS = ("success_rate", "mean_reward", "mean_turns", "format_error_rate", "invalid_action_rate")


def _iteration_of(stage: str) -> int | None:
    if stage.startswith("bc/") or stage == "bc":
        return 0
    match = re.match(r"iter_(\d+)/", stage)
    return int(match.group(1)) if match else None


def collect_series(stages: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """metric -> eval split -> [(iteration, value)] for every ``.../eval_<split>`` stage."""
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for stage in stages:
        name = stage["name"]
        iteration = _iteration_of(name)
        leaf = name.rsplit("/", 1)[-1]
        if iteration is None or not leaf.startswith("eval_"):
            continue
        split = leaf[len("eval_"):]
        for metric in PLOTTED_METRICS:
            value = stage["metrics"].get(metric)
            if isinstance(value, (int, float)):
                series.setdefault(metric, {}).setdefault(split, []).append((iteration, float(value)))
    return series


_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def svg_line_plot(title: str, lines: dict[str, list[tuple[int, float]]], width: int = 360, height: int = 220) -> str:
    points = [p for pts in lines.values() for p in pts]
    if not points:
        return ""
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y0, y1 = min(0.0, min(ys)), max(ys) if max(ys) > min(0.0, min(ys)) else min(0.0, min(ys)) + 1
    pad = 36

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (width - 2 * pad)

    def sy(y: float) -> float:
        return height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad)

    parts = [f'<svg class="plot" width="{width}" height="{height}" role="img" aria-label="{html.escape(title)}">',
             f'<text x="{width / 2}" y="16" text-anchor="middle" class="title">{html.escape(title)}</text>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#888"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#888"/>',
             f'<text x="{pad - 4}" y="{sy(y1) + 4}" text-anchor="end" class="tick">{y1:.2f}</text>',
             f'<text x="{pad - 4}" y="{sy(y0) + 4}" text-anchor="end" class="tick">{y0:.2f}</text>']
    for x in sorted(set(xs)):
        label = "BC" if x == 0 else f"it {x}"
        parts.append(f'<text x="{sx(x)}" y="{height - pad + 16}" text-anchor="middle" class="tick">{label}</text>')
    for i, (name, pts) in enumerate(sorted(lines.items())):
        colour = _COLOURS[i % len(_COLOURS)]
        pts = sorted(pts)
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}"/>')
        for x, y in pts:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"><title>{html.escape(name)} '
                         f'{y:.3f}</title></circle>')
        parts.append(f'<text x="{width - pad}" y="{pad + 14 * i}" text-anchor="end" fill="{colour}" class="tick">'
                     f'{html.escape(name)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:+.3f}"


def advantage_colour(value: float | None, scale: float) -> str:
    if value is None or scale <= 0:
        return "transparent"
    strength = min(abs(value) / scale, 1.0)
    hue = 130 if value >= 0 else 0
    return f"hsla({hue}, 70%, 45%, {0.15 + 0.6 * strength:.2f})"


def episode_html(ep: Episode, scale: float) -> str:
    status = "won" if ep.won else "lost"
    rows = []
    for t, turn in enumerate(ep.turns):
        rows.append(
            "<tr>"
            f"<td>{t}</td><td class='obs'>{html.escape(turn.observation)}</td>"
            f"<td class='act'>{html.escape(turn.action or '(format error) ' + turn.agent_text)}</td>"
            f"<td>{turn.reward:g}</td><td>{_fmt(turn.r_aux)}</td><td>{_fmt(turn.value)}</td><td>{_fmt(turn.q_value)}</td>"
            f"<td style='background:{advantage_colour(turn.advantage, scale)}'>{_fmt(turn.advantage)}</td>"
            "</tr>"
        )
    return (f"<details class='episode {status}'><summary>{html.escape(ep.task_id)} &middot; {ep.source} &middot; "
            f"<b>{status}</b> &middot; score {ep.score:.2f} &middot; {ep.num_turns} turns</summary>"
            "<table><tr><th>t</th><th>observation</th><th>action</th><th>r_env</th><th>r_aux</th><th>V</th>"
            f"<th>Q</th><th>process reward</th></tr>{''.join(rows)}</table>"
            f"<p class='final'>final observation: {html.escape(ep.final_observation)}</p></details>")


STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}
.plot{border:1px solid #ddd;margin:4px}.plot .title{font-weight:600;font-size:13px}.plot .tick{font-size:10px}
table{border-collapse:collapse;width:100%;font-size:12px}td,th{border:1px solid #ddd;padding:3px;vertical-align:top}
td.obs{max-width:520px;white-space:pre-wrap}td.act{font-family:monospace}
details{margin:4px 0}details.won summary b{color:#2a2}details.lost summary b{color:#c22}
"""


def build_report(run_root: str | Path, max_episodes: int = 200) -> Path:
    """Write ``run_root/report.html``; returns its path."""
    run_root = Path(run_root)
    manifest_path = run_root / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{run_root}: no manifest.json (not a qevolve run directory)")
    manifest = json.loads(manifest_path.read_text())
    stages = manifest.get("stages", [])
    series = collect_series(stages)
    plots = "".join(svg_line_plot(metric, lines) for metric, lines in series.items())
    summary_rows = "".join(
        f"<tr><td>{html.escape(s['name'])}</td><td>{html.escape(json.dumps(s['metrics'], sort_keys=True))}</td></tr>"
        for s in stages)
    buffers = []
    for stage in stages:
        labelled = stage["outputs"].get("labelled")
        if not labelled or not (run_root / labelled).exists():
            continue
        episodes = read_episodes(run_root / labelled)
        advantages = [abs(t.advantage) for ep in episodes for t in ep.turns if t.advantage is not None]
        scale = sorted(advantages)[int(0.95 * (len(advantages) - 1))] if advantages else 1.0
        shown = episodes[:max_episodes]
        buffers.append(f"<h3>{html.escape(labelled)} ({len(episodes)} episodes, {len(shown)} shown)</h3>"
                       + "".join(episode_html(ep, scale) for ep in shown))
    versions = html.escape(json.dumps(manifest.get("versions", {}), sort_keys=True))
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>qevolve run report</title>"
        f"<style>{STYLE}</style></head><body>"
        f"<h1>qevolve run: {html.escape(run_root.name)}</h1><p>versions: <code>{versions}</code></p>"
        f"<h2>Metrics per iteration</h2><div id='plots'>{plots or '<p>no evaluation stages yet</p>'}</div>"
        f"<h2>Stages</h2><table id='stages'><tr><th>stage</th><th>metrics</th></tr>{summary_rows}</table>"
        f"<h2>Trajectories</h2><div id='trajectories'>{''.join(buffers) or '<p>no labelled buffers yet</p>'}</div>"
        "</body></html>"
    )
    out = run_root / "report.html"
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(page)
    tmp.replace(out)
    return out
