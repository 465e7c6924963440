"""``qevolve report runs/NAME``: one static HTML page for a run.

The page is a single file with inline SVG plots: no JavaScript, no external resource, no plotting
dependency. Its sections:

* **Methods compared**: per evaluation split, every evaluated policy (SFT/BC, Q-Evolve after each
  iteration, the baselines and variants) with its success rate and mean reward, and its difference
  from SFT with the 95% paired-bootstrap interval of ``qevolve compare`` (same function, resamples
  and seed, so the numbers match ``results.md``).
* **Metrics per iteration**: the Q-Evolve line (BC at 0, iteration k at k); baselines and variants
  are separate, labelled markers beside their iteration, never joined to the line.
* **Training curves**: what each training stage logged per step (``scalars.jsonl``, or the
  TensorBoard event files of older runs) and the critic's per-epoch history.
* **Stage metrics**: the manifest's metrics of every stage, rounded.
* **Evaluation trajectories** and **labelled buffers**: every turn's observation, action and
  reward (labelled buffers add r_aux, V, Q and the process reward, coloured from red to green),
  collapsed by default.
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path
from typing import Any, NamedTuple

from qevolve.buffer.store import Episode, read_episodes, shard_paths

PLOTTED_METRICS = ("success_rate", "mean_reward", "mean_turns", "format_error_rate", "invalid_action_rate")

METRIC_TITLES = {"success_rate": "success rate", "mean_reward": "mean final reward", "mean_turns": "turns per episode",
                 "format_error_rate": "format errors per turn", "invalid_action_rate": "invalid actions per turn"}

#: one colour per evaluation split, everywhere on the page (bars, lines, markers)
SPLIT_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
#: the colours of the curves inside one training panel
SERIES_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
#: marker shapes of the baselines and variants (the Q-Evolve line has circles)
MARKER_SHAPES = ["square", "triangle", "diamond", "triangle-down", "pentagon", "star"]
WHISKER_COLOUR = "#222222"

#: training curves drawn together, in this order; any other logged tag goes to a collapsed "more" block
TRAINING_PANELS: list[tuple[str, list[str]]] = [
    ("loss", ["train/loss", "eval/agent_nll", "policy/loss"]),
    ("agent-token accuracy", ["train/agent_accuracy", "eval/agent_accuracy"]),
    ("KL divergence", ["policy/kl_ref", "policy/approx_kl_old"]),
    ("probability ratio π/π_old", ["policy/ratio_mean", "policy/ratio_min", "policy/ratio_max"]),
    ("clip fraction", ["policy/clip_frac_low", "policy/clip_frac_high"]),
    ("policy objective", ["policy/policy_objective"]),
    ("AWR weighted NLL", ["policy/weighted_nll"]),
    ("AWR weights", ["policy/weight_mean", "policy/weight_max"]),
    ("AWR clamped fraction", ["policy/weight_clamp_frac"]),
    ("DPO loss", ["policy/dpo_loss"]),
    ("DPO reward margin", ["policy/reward_margin"]),
    ("DPO reward accuracy", ["policy/reward_accuracy"]),
    ("log-ratio to the reference", ["policy/chosen_logratio", "policy/rejected_logratio"]),
    ("critic V loss (expectile)", ["critic/loss_v"]),
    ("critic Q loss (TD)", ["critic/loss_q"]),
    ("V by final score (> 0, = 0; not won/lost)", ["critic/v_scored", "critic/v_unscored", "critic/v_mean"]),
    ("explained variance of V", ["critic/explained_variance", "critic/heldout_explained_variance",
                                 "critic/kfold_explained_variance"]),
    ("AUC of V(s_0), won vs lost (held out)", ["critic/kfold_auc_won_vs_lost"]),
    ("gradient norm", ["train/grad_norm", "policy/grad_norm"]),
    ("learning rate", ["train/lr"]),
]

#: legend entries of curves that measure one quantity on different data; a panel showing only one of
#: them names it in its title instead, since a single curve has no legend
SERIES_LABELS = {"critic/explained_variance": "in-sample", "critic/heldout_explained_variance": "held-out",
                 "critic/kfold_explained_variance": "k-fold held-out"}

MAX_CURVE_POINTS = 500  # longer curves are drawn as means of consecutive steps (the page stays small)


# -- numbers ------------------------------------------------------------------------------------------

def fmt_number(value: Any) -> str:
    """A metric for reading: integers whole, other numbers to 4 significant digits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return html.escape(str(value))
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    if abs(value) >= 1e4:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten) spanning [low, high] tightly, about
    ``count`` intervals."""
    if not high > low:
        low, high = low - 0.5, high + 0.5
    raw = (high - low) / count
    best: tuple[Any, ...] | None = None
    for exponent in range(math.floor(math.log10(raw)) - 1, math.floor(math.log10(raw)) + 2):
        for m in (1, 2, 2.5, 5):
            step = m * 10.0 ** exponent
            first, last = math.floor(low / step + 1e-9) * step, math.ceil(high / step - 1e-9) * step
            n = round((last - first) / step) + 1
            if 3 <= n <= count + 3:
                key = (round((last - first) / (high - low), 6), m == 2.5, abs(n - count - 1))
                if best is None or key < best[0]:
                    best = (key, first, step, n)
    _, first, step, n = best
    return [round(first + i * step, 12) for i in range(n)]


def _tick_label(value: float, ticks: list[float]) -> str:
    """A tick's label with as many digits as the tick step needs (no two ticks read the same)."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    decimals = next((d for d in range(16) if abs(round(step, d) - step) <= 1e-9 * step), 6)
    largest = max(abs(t) for t in ticks)
    if 0 < step < 1e-3 and largest < 1e-2:  # small numbers: in scientific notation
        if value == 0:
            return "0"
        digits = max(1, math.floor(math.log10(largest)) - math.floor(math.log10(step))
                     + (1 if round(step / 10 ** math.floor(math.log10(step)), 6) % 1 else 0))
        return f"{value:.{digits}e}"
    return f"{value:,.{decimals}f}"


def _e(text: Any) -> str:
    return html.escape(str(text))


# -- SVG pieces ---------------------------------------------------------------------------------------

class Line(NamedTuple):
    label: str
    colour: str
    points: list[tuple[float, float]]
    dots: bool = False  # a circle on every point


class Marker(NamedTuple):
    label: str  # legend entry (shape)
    colour: str
    shape: str
    x: float
    y: float
    note: str  # tooltip


def marker_svg(shape: str, cx: float, cy: float, colour: str, size: float = 5.5, note: str = "") -> str:
    """A filled marker with a dark outline; ``data-cx``/``data-cy`` give its centre."""
    s = size
    if shape == "circle":
        body = f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{s * 0.8:.1f}"'
    else:
        if shape == "square":
            pts = [(-s, -s), (s, -s), (s, s), (-s, s)]
        elif shape == "triangle":
            pts = [(0, -s * 1.2), (s * 1.1, s * 0.8), (-s * 1.1, s * 0.8)]
        elif shape == "triangle-down":
            pts = [(0, s * 1.2), (s * 1.1, -s * 0.8), (-s * 1.1, -s * 0.8)]
        elif shape == "diamond":
            pts = [(0, -s * 1.3), (s * 1.1, 0), (0, s * 1.3), (-s * 1.1, 0)]
        elif shape == "pentagon":
            pts = [(s * 1.2 * math.sin(2 * math.pi * k / 5), -s * 1.2 * math.cos(2 * math.pi * k / 5)) for k in range(5)]
        else:  # star
            pts = [((s * 1.4 if k % 2 == 0 else s * 0.7) * math.sin(math.pi * k / 5),
                    -(s * 1.4 if k % 2 == 0 else s * 0.7) * math.cos(math.pi * k / 5)) for k in range(10)]
        body = '<polygon points="' + " ".join(f"{cx + x:.1f},{cy + y:.1f}" for x, y in pts) + '"'
    title = f"<title>{_e(note)}</title>" if note else ""
    return (f'{body} class="marker" data-cx="{cx:.1f}" data-cy="{cy:.1f}" fill="{colour}" stroke="#222" '
            f'stroke-width="1">{title}</{"circle" if shape == "circle" else "polygon"}>')


def _legend(entries: list[tuple[str, str, str]], x: float, y: float, width: float) -> tuple[str, float]:
    """Legend entries (label, colour, kind: 'line' or a marker shape) flowed in rows from (x, y);
    returns the SVG and the height used."""
    parts, cx, cy = [], x, y
    for label, colour, kind in entries:
        needed = 26 + 6.2 * len(label) + 14
        if cx > x and cx + needed > x + width:
            cx, cy = x, cy + 16
        if kind == "line":
            parts.append(f'<line class="legend-swatch" x1="{cx:.1f}" y1="{cy:.1f}" x2="{cx + 20:.1f}" y2="{cy:.1f}" '
                         f'stroke="{colour}" stroke-width="3"/>')
        elif kind == "bar":
            parts.append(f'<rect class="legend-swatch" x="{cx + 2:.1f}" y="{cy - 5:.1f}" width="16" height="10" '
                         f'fill="{colour}"/>')
        else:
            parts.append(marker_svg(kind, cx + 10, cy, colour).replace('class="marker"', 'class="legend-marker"'))
        parts.append(f'<text x="{cx + 26:.1f}" y="{cy + 4:.1f}" class="legend">{_e(label)}</text>')
        cx += needed
    return "".join(parts), (cy - y + 16) if entries else 0.0


_plot_ids = iter(range(1 << 30))


def _svg_open(kind: str, title: str, width: float, height: float) -> str:
    return (f'<svg class="plot" id="{kind}-{next(_plot_ids)}" data-kind="{kind}" width="{width:.0f}" '
            f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{_e(title)}">'
            f'<rect x="0" y="0" width="{width:.0f}" height="{height:.0f}" fill="#ffffff"/>'
            f'<text x="{width / 2:.1f}" y="16" text-anchor="middle" class="title">{_e(title)}</text>')


def line_chart(title: str, lines: list[Line], markers: list[Marker] = (), *, x_label: str = "",
               x_names: dict[float, str] | None = None, width: int = 380, height: int = 230,
               legend: bool = True, kind: str = "lines") -> str:
    """Lines (and free-standing markers) on linear axes, with round ticks and a legend below.

    ``x_names``: tick labels at those x values (iterations) instead of round numbers."""
    xs = [x for line in lines for x, _ in line.points] + [m.x for m in markers]
    ys = [y for line in lines for _, y in line.points] + [m.y for m in markers]
    if not xs:
        return ""
    left, right, top = 52, 14, 26
    low, high = min(ys), max(ys)
    if low == high and low >= 0:  # a flat non-negative curve: from 0, not centred on its value
        low, high = 0.0, max(high, 1.0)
    y_ticks = _ticks(low, high, 4)
    y0, y1 = y_ticks[0], y_ticks[-1]
    if x_names:
        x0, x1 = min(min(xs), min(x_names)) - 0.3, max(max(xs), max(x_names)) + 0.3
        x_ticks = sorted(x_names)
    else:
        x_ticks = _ticks(min(xs), max(xs), 5)
        x0, x1 = x_ticks[0], x_ticks[-1]
    entries = []
    if legend:
        seen: set[tuple[str, str]] = set()
        for line in lines:
            entries.append((line.label, line.colour, "line"))
        for m in markers:
            if (m.label, m.shape) not in seen:
                seen.add((m.label, m.shape))
                entries.append((m.label, "#bbbbbb", m.shape))
    legend_svg, legend_height = _legend(entries, left, 0, width - left - right)
    plot_bottom = height - 34
    total_height = height + legend_height + (8 if entries else 0)

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def sy(y: float) -> float:
        return plot_bottom - (y - y0) / (y1 - y0) * (plot_bottom - top)

    parts = [_svg_open(kind, title, width, total_height)]
    for t in y_ticks:
        parts.append(f'<line x1="{left}" y1="{sy(t):.1f}" x2="{width - right}" y2="{sy(t):.1f}" stroke="#eeeeee"/>'
                     f'<text x="{left - 4}" y="{sy(t) + 3.5:.1f}" text-anchor="end" class="tick">'
                     f'{_tick_label(t, y_ticks)}</text>')
    for t in x_ticks:
        label = x_names[t] if x_names else _tick_label(t, x_ticks)
        parts.append(f'<line x1="{sx(t):.1f}" y1="{plot_bottom}" x2="{sx(t):.1f}" y2="{plot_bottom + 4}" stroke="#888"/>'
                     f'<text x="{sx(t):.1f}" y="{plot_bottom + 15}" text-anchor="middle" class="tick">{_e(label)}</text>')
    parts.append(f'<line x1="{left}" y1="{plot_bottom}" x2="{width - right}" y2="{plot_bottom}" stroke="#888"/>'
                 f'<line x1="{left}" y1="{top}" x2="{left}" y2="{plot_bottom}" stroke="#888"/>')
    if x_label:
        parts.append(f'<text x="{(left + width - right) / 2:.1f}" y="{plot_bottom + 28}" text-anchor="middle" '
                     f'class="axis">{_e(x_label)}</text>')
    for line in lines:
        pts = sorted(line.points)
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        parts.append(f'<polyline class="series" fill="none" stroke="{line.colour}" stroke-width="2" '
                     f'stroke-linejoin="round" points="{path}"><title>{_e(line.label)}</title></polyline>')
        if line.dots or len(pts) == 1:
            parts += [marker_svg("circle", sx(x), sy(y), line.colour, 4.5, f"{line.label}: {fmt_number(y)}")
                      for x, y in pts]
    for m in markers:
        parts.append(marker_svg(m.shape, sx(m.x), sy(m.y), m.colour, 5.5, m.note))
    if entries:
        parts.append(f'<g transform="translate(0 {height + 6})">{legend_svg}</g>')
    parts.append("</svg>")
    return "".join(parts)


def method_chart(metric: str, methods: list[str], splits: list[str], values: dict[tuple[str, str], float],
                 diffs: dict[tuple[str, str], tuple[float, float, float]], baseline: str) -> str:
    """Rows of methods, one bar per split: the metric (left) and its difference from ``baseline`` with
    the 95% interval as a whisker (right), the difference and interval written out beside it."""
    if not values:
        return ""
    title = METRIC_TITLES.get(metric, metric)
    label_width = min(230, 14 + 6.4 * max(len(m) for m in methods))
    abs_width, diff_width, text_width = 230, 280, 60 + 150 * len(splits)
    bar_h, gap = 12, 10
    row_h = bar_h * len(splits) + gap
    top = 42
    width = label_width + abs_width + 24 + diff_width + text_width
    plot_bottom = top + row_h * len(methods)
    height = plot_bottom + 34
    colours = {split: SPLIT_COLOURS[i % len(SPLIT_COLOURS)] for i, split in enumerate(splits)}
    legend_svg, legend_height = _legend([(split, colours[split], "bar") for split in splits], label_width,
                                        0, width - label_width)
    total_height = height + legend_height + 6

    a0 = min(0.0, min(values.values()))
    a1 = max(1.0 if metric.endswith("rate") else 0.0, max(values.values()))
    a_ticks = _ticks(a0, a1 if a1 > a0 else a0 + 1.0, 4)
    ax0, ax1 = label_width, label_width + abs_width

    def sa(v: float) -> float:
        return ax0 + (v - a_ticks[0]) / (a_ticks[-1] - a_ticks[0]) * (ax1 - ax0)

    bounds = [b for d in diffs.values() for b in d] + [0.0]
    d_ticks = _ticks(min(bounds), max(bounds), 4)
    dx0, dx1 = ax1 + 24, ax1 + 24 + diff_width

    def sd(v: float) -> float:
        return dx0 + (v - d_ticks[0]) / (d_ticks[-1] - d_ticks[0]) * (dx1 - dx0)

    parts = [_svg_open("methods", f"{title} by method", width, total_height)]
    parts.append(f'<text x="{(ax0 + ax1) / 2:.1f}" y="34" text-anchor="middle" class="axis">{_e(title)}</text>'
                 f'<text x="{(dx0 + dx1) / 2:.1f}" y="34" text-anchor="middle" class="axis">'
                 f'difference from {_e(baseline)}, 95% CI</text>'
                 f'<text x="{dx1 + 10:.1f}" y="34" class="axis">difference [95% CI]</text>')
    for ticks, scale, x_from, x_to in ((a_ticks, sa, ax0, ax1), (d_ticks, sd, dx0, dx1)):
        for t in ticks:
            parts.append(f'<line x1="{scale(t):.1f}" y1="{top - 2}" x2="{scale(t):.1f}" y2="{plot_bottom}" '
                         f'stroke="{"#888" if t == 0 else "#eeeeee"}"/>'
                         f'<text x="{scale(t):.1f}" y="{plot_bottom + 14}" text-anchor="middle" class="tick">'
                         f'{_tick_label(t, ticks)}</text>')
        parts.append(f'<line x1="{x_from}" y1="{plot_bottom}" x2="{x_to}" y2="{plot_bottom}" stroke="#888"/>')
    for row, method in enumerate(methods):
        y_row = top + row * row_h + gap / 2
        if row % 2:
            parts.append(f'<rect x="0" y="{y_row - gap / 2:.1f}" width="{label_width - 4:.1f}" height="{row_h}" '
                         f'fill="#f6f6f6"/>')
        parts.append(f'<text x="{label_width - 8:.1f}" y="{y_row + row_h / 2 - gap / 2 + 4:.1f}" text-anchor="end" '
                     f'class="label">{_e(method)}</text>')
        for i, split in enumerate(splits):
            y = y_row + i * bar_h
            value = values.get((method, split))
            if value is None:
                continue
            x_a, x_b = sorted((sa(0.0 if a_ticks[0] <= 0 else a_ticks[0]), sa(value)))
            parts.append(f'<rect class="bar" x="{x_a:.1f}" y="{y + 1:.1f}" width="{max(x_b - x_a, 1.5):.1f}" '
                         f'height="{bar_h - 2}" fill="{colours[split]}"><title>{_e(method)}, {_e(split)}: '
                         f'{fmt_number(value)}</title></rect>'
                         f'<text x="{x_b + 3:.1f}" y="{y + bar_h - 3:.1f}" class="tick">{fmt_number(value)}</text>')
            diff = diffs.get((method, split))
            if method == baseline:
                parts.append(f'<text x="{dx1 + 10:.1f}" y="{y + bar_h - 3:.1f}" class="tick">{_e(split)}: '
                             f'the baseline</text>')
                continue
            if diff is None:
                parts.append(f'<text x="{dx1 + 10:.1f}" y="{y + bar_h - 3:.1f}" class="tick">{_e(split)}: '
                             f'not paired</text>')
                continue
            d, lo, hi = diff
            x_a, x_b = sorted((sd(0.0), sd(d)))
            mid = y + bar_h / 2
            parts.append(f'<rect class="bar" x="{x_a:.1f}" y="{y + 2:.1f}" width="{max(x_b - x_a, 1.5):.1f}" '
                         f'height="{bar_h - 4}" fill="{colours[split]}"/>'
                         f'<line class="ci" x1="{sd(lo):.1f}" y1="{mid:.1f}" x2="{sd(hi):.1f}" y2="{mid:.1f}" '
                         f'stroke="{WHISKER_COLOUR}" stroke-width="1.5"><title>{_e(method)}, {_e(split)}: '
                         f'{d:+.3f} [{lo:+.3f}, {hi:+.3f}]</title></line>'
                         f'<line class="ci-cap" x1="{sd(lo):.1f}" y1="{mid - 5:.1f}" x2="{sd(lo):.1f}" y2="{mid + 5:.1f}" '
                         f'stroke="{WHISKER_COLOUR}" stroke-width="1.5"/>'
                         f'<line class="ci-cap" x1="{sd(hi):.1f}" y1="{mid - 5:.1f}" x2="{sd(hi):.1f}" y2="{mid + 5:.1f}" '
                         f'stroke="{WHISKER_COLOUR}" stroke-width="1.5"/>'
                         f'<text x="{dx1 + 10:.1f}" y="{y + bar_h - 3:.1f}" class="tick">{_e(split)}: '
                         f'{d:+.3f} [{lo:+.3f}, {hi:+.3f}]</text>')
    parts.append(f'<g transform="translate(0 {height - 2})">{legend_svg}</g></svg>')
    return "".join(parts)


# -- what the run holds -------------------------------------------------------------------------------

def _split_of(stage: str) -> tuple[str, str] | None:
    """(prefix, split) of an evaluation stage ``<prefix>/eval_<split>``."""
    prefix, _, leaf = stage.rpartition("/")
    return (prefix, leaf[len("eval_"):]) if leaf.startswith("eval_") and prefix else None


def _qevolve_iteration(prefix: str) -> int | None:
    """k for the policies of the Q-Evolve line (``bc`` = 0, ``iter_k`` = k); None for baselines and variants."""
    if prefix == "bc":
        return 0
    match = re.fullmatch(r"iter_(\d+)", prefix)
    return int(match.group(1)) if match else None


def _prefix_iteration(prefix: str) -> int | None:
    match = re.match(r"iter_(\d+)(/|$)", prefix)
    return 0 if prefix == "bc" else int(match.group(1)) if match else None


def _method_order(prefixes: list[str]) -> list[str]:
    """BC, then Q-Evolve by iteration, then the baselines and variants in the order the run made them."""
    def key(item: tuple[int, str]) -> tuple[int, int, int]:
        index, prefix = item
        k = _qevolve_iteration(prefix)
        return (0, k, index) if k is not None else (1, 0, index)
    unique = list(dict.fromkeys(prefixes))
    return [prefix for _, prefix in sorted(enumerate(unique), key=key)]


def collect_series(stages: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The Q-Evolve line: metric -> eval split -> [(iteration, value)] of the ``bc/eval_<split>`` and
    ``iter_k/eval_<split>`` stages only (baselines and variants are :func:`collect_points`)."""
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for stage in stages:
        found = _split_of(stage["name"])
        if found is None or _qevolve_iteration(found[0]) is None:
            continue
        for metric in PLOTTED_METRICS:
            value = stage["metrics"].get(metric)
            if isinstance(value, (int, float)):
                series.setdefault(metric, {}).setdefault(found[1], []).append(
                    (_qevolve_iteration(found[0]), float(value)))
    return series


def collect_points(stages: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, tuple[int, float]]]]:
    """Baselines and variants: metric -> method prefix (``iter_1/rft``) -> split -> (iteration, value). The
    online baselines' policies evaluated on the way (``iter_1/grpo/round_r``) are left to the env-steps plot,
    where they lie on their line; here each baseline is its last policy."""
    from qevolve.evaluation.compare import ROUND_PREFIX

    points: dict[str, dict[str, dict[str, tuple[int, float]]]] = {}
    for stage in stages:
        found = _split_of(stage["name"])
        if found is None or _qevolve_iteration(found[0]) is not None or ROUND_PREFIX.fullmatch(found[0]):
            continue
        iteration = _prefix_iteration(found[0])
        if iteration is None:
            continue
        for metric in PLOTTED_METRICS:
            value = stage["metrics"].get(metric)
            if isinstance(value, (int, float)):
                points.setdefault(metric, {}).setdefault(found[0], {})[found[1]] = (iteration, float(value))
    return points


def iteration_plots(stages: list[dict[str, Any]], splits: list[str]) -> str:
    from qevolve.evaluation.compare import method_name

    lines_by_metric, points_by_metric = collect_series(stages), collect_points(stages)
    colours = {split: SPLIT_COLOURS[i % len(SPLIT_COLOURS)] for i, split in enumerate(splits)}
    methods = _method_order([p for metric in points_by_metric.values() for p in metric])
    shapes = {prefix: MARKER_SHAPES[i % len(MARKER_SHAPES)] for i, prefix in enumerate(methods)}
    plots = []
    for metric in PLOTTED_METRICS:
        lines = [Line(f"Q-Evolve · {split}", colours[split], [(float(k), v) for k, v in pts], dots=True)
                 for split, pts in lines_by_metric.get(metric, {}).items()]
        markers = []
        for index, prefix in enumerate(methods):
            for split, (k, value) in points_by_metric.get(metric, {}).get(prefix, {}).items():
                # beside the iteration's Q-Evolve point, not on it: a baseline never reads as the line's value
                markers.append(Marker(method_name(prefix), colours[split], shapes[prefix], k + 0.12 * (index + 1),
                                      value, f"{method_name(prefix)} · {split}: {fmt_number(value)}"))
        if not lines and not markers:
            continue
        iterations = sorted({int(x) for line in lines for x, _ in line.points} | {int(m.x) for m in markers})
        plots.append(line_chart(METRIC_TITLES.get(metric, metric), lines, markers, x_label="iteration",
                                x_names={float(k): "BC" if k == 0 else f"iter {k}" for k in iterations},
                                kind="iterations"))
    return "".join(plots)



# -- success against env steps ------------------------------------------------------------------------

ENV_STEP_METRICS = ("success_rate", "mean_reward")
ENV_STEPS_PNG = "env_steps.png"


class EnvStepPoint(NamedTuple):
    method: str  # the table's name of the policy
    on_line: bool  # on the Q-Evolve line (BC and the policy after each iteration)
    split: str
    env_steps: int
    value: float
    series: str | None = None  # an online baseline's line (its policies on the way and its last), e.g. "GRPO"


def _online_series(prefix: str) -> str | None:
    """The online baseline whose line the policy of ``prefix`` lies on (``iter_k/NAME``, one of its rounds
    ``iter_k/NAME/round_r`` or budgets ``iter_k/NAME@B``), by its table name; None for any other policy."""
    from qevolve.evaluation.compare import BUDGET_PREFIX, ONLINE_BASELINES, ROUND_PREFIX, method_name

    match = BUDGET_PREFIX.fullmatch(prefix) or ROUND_PREFIX.fullmatch(prefix)
    if match is not None:
        return method_name(f"iter_{match.group(1)}/{match.group(2)}")
    match = re.fullmatch(r"iter_\d+/([^/]+)", prefix)
    return method_name(prefix) if match is not None and match.group(1) in ONLINE_BASELINES else None


def env_step_points(stages: list[dict[str, Any]],
                    budgets: dict[str, list[int]] | None = None) -> dict[str, list[EnvStepPoint]]:
    """metric -> every evaluated policy whose env steps are known: its steps (the rollouts of the interaction
    that produced it, as ``qevolve compare`` counts them) and its value on each evaluation split. An online
    baseline's policies evaluated on the way are named by the ``budgets`` they stand for (as ``qevolve
    compare`` names them) and lie on its line with its last policy."""
    from qevolve.evaluation.compare import evaluated_methods, method_name, policy_env_steps

    methods = evaluated_methods(stages, budgets or {})
    points: dict[str, list[EnvStepPoint]] = {}
    for stage in stages:
        found = _split_of(stage["name"])
        if found is None:
            continue
        evaluated, split = found
        for prefix in methods.get(evaluated, [evaluated]):
            steps = policy_env_steps(stages, prefix)
            if steps is None:
                continue
            for metric in ENV_STEP_METRICS:
                value = stage["metrics"].get(metric)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    points.setdefault(metric, []).append(EnvStepPoint(
                        method_name(prefix), _qevolve_iteration(prefix) is not None, split, steps, float(value),
                        _online_series(prefix)))
    return points


def _env_step_styles(points: dict[str, list[EnvStepPoint]], splits: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Colours by split and marker shapes by method (off the line), the same on the page and in the PNG."""
    all_splits = list(dict.fromkeys([*splits, *(p.split for pts in points.values() for p in pts)]))
    colours = {split: SPLIT_COLOURS[i % len(SPLIT_COLOURS)] for i, split in enumerate(all_splits)}
    # one shape per method off the Q-Evolve line; an online baseline's points share its line's shape
    methods = list(dict.fromkeys(p.series or p.method for pts in points.values() for p in pts if not p.on_line))
    shapes = {method: MARKER_SHAPES[i % len(MARKER_SHAPES)] for i, method in enumerate(methods)}
    return colours, shapes


def _series_lines(pts: list[EnvStepPoint], split: str) -> dict[str, list[tuple[float, float]]]:
    """Online baseline -> its points on ``split`` by env steps (a budget its last round reached too is one point)."""
    lines: dict[str, list[tuple[float, float]]] = {}
    for p in pts:
        if p.series is not None and p.split == split:
            lines.setdefault(p.series, []).append((float(p.env_steps), p.value))
    return {series: sorted(set(points)) for series, points in lines.items()}


def env_steps_plots(points: dict[str, list[EnvStepPoint]], splits: list[str]) -> str:
    """The page's plots of success and mean reward against env steps: the Q-Evolve line, other methods as markers."""
    colours, shapes = _env_step_styles(points, splits)
    plots = []
    for metric in ENV_STEP_METRICS:
        pts = points.get(metric, [])
        if not pts:
            continue
        lines = [Line(f"Q-Evolve · {split}", colour,
                      sorted((float(p.env_steps), p.value) for p in pts if p.on_line and p.split == split), dots=True)
                 for split, colour in colours.items() if any(p.on_line and p.split == split for p in pts)]
        lines += [Line(f"{series} · {split}", colour, line) for split, colour in colours.items()
                  for series, line in _series_lines(pts, split).items() if len(line) > 1]
        markers = [Marker(p.method, colours[p.split], shapes[p.series or p.method], float(p.env_steps), p.value,
                          f"{p.method} · {p.split}: {fmt_number(p.value)} at {p.env_steps:,} env steps")
                   for p in pts if not p.on_line]
        plots.append(line_chart(f"{METRIC_TITLES[metric]} against env steps", lines, markers,
                                x_label="env steps of the policy's own interaction", kind="env-steps"))
    return "".join(plots)


def _glyph(draw: Any, shape: str, cx: float, cy: float, r: float, colour: str) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
        return
    corners = {"square": [(-1, -1), (1, -1), (1, 1), (-1, 1)], "triangle": [(0, -1.2), (1.1, 0.9), (-1.1, 0.9)],
               "triangle-down": [(0, 1.2), (1.1, -0.9), (-1.1, -0.9)],
               "diamond": [(0, -1.3), (1.3, 0), (0, 1.3), (-1.3, 0)],
               "pentagon": [(math.sin(a) * 1.2, -math.cos(a) * 1.2) for a in (i * 2 * math.pi / 5 for i in range(5))],
               "star": [(math.sin(a) * (1.3 if i % 2 == 0 else 0.55), -math.cos(a) * (1.3 if i % 2 == 0 else 0.55))
                        for i, a in enumerate(j * math.pi / 5 for j in range(10))]}
    draw.polygon([(cx + x * r, cy + y * r) for x, y in corners.get(shape, corners["square"])], fill=colour)


def write_env_steps_png(points: dict[str, list[EnvStepPoint]], splits: list[str], path: Path,
                        width: int = 960, height: int = 420) -> dict[tuple[str, str, str], tuple[float, float]]:
    """The plots of :func:`env_steps_plots` as one PNG (for papers and slides), written atomically. Returns
    where each point was drawn, ``(metric, method, split) -> (x, y)`` in pixels (what the tests check)."""
    from PIL import Image, ImageDraw, ImageFont

    from qevolve.atomic_io import atomic_write

    colours, shapes = _env_step_styles(points, splits)
    panels = [metric for metric in ENV_STEP_METRICS if points.get(metric)]
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    drawn: dict[tuple[str, str, str], tuple[float, float]] = {}
    legend_top = height - 56
    for index, metric in enumerate(panels):
        pts = points[metric]
        x_off = index * width / max(len(panels), 1)
        left, right, top, bottom = x_off + 64, x_off + width / max(len(panels), 1) - 24, 34, legend_top - 34
        x_ticks = _ticks(min(p.env_steps for p in pts), max(p.env_steps for p in pts), 5)
        low, high = min(p.value for p in pts), max(p.value for p in pts)
        y_ticks = _ticks(min(low, 0.0), max(high, 1.0) if metric == "success_rate" else high, 4)

        def sx(x: float) -> float:
            return left + (x - x_ticks[0]) / ((x_ticks[-1] - x_ticks[0]) or 1.0) * (right - left)

        def sy(y: float) -> float:
            return bottom - (y - y_ticks[0]) / ((y_ticks[-1] - y_ticks[0]) or 1.0) * (bottom - top)

        draw.text(((left + right) / 2, 10), f"{METRIC_TITLES[metric]} against env steps", fill="black", font=font,
                  anchor="mt")
        draw.rectangle([left, top, right, bottom], outline="#888888")
        for tick in y_ticks:
            draw.line([(left - 4, sy(tick)), (right, sy(tick))], fill="#e6e6e6")
            draw.text((left - 8, sy(tick)), _tick_label(tick, y_ticks), fill="black", font=font, anchor="rm")
        for tick in x_ticks:
            draw.line([(sx(tick), bottom), (sx(tick), bottom + 4)], fill="#888888")
            draw.text((sx(tick), bottom + 8), _tick_label(tick, x_ticks), fill="black", font=font, anchor="mt")
        draw.text(((left + right) / 2, bottom + 22), "env steps of the policy's own interaction", fill="#444444",
                  font=font, anchor="mt")
        for split, colour in colours.items():
            line = sorted((p.env_steps, p.value, p.method) for p in pts if p.on_line and p.split == split)
            if len(line) > 1:
                draw.line([(sx(x), sy(y)) for x, y, _ in line], fill=colour, width=2)
            for x, y, method in line:
                _glyph(draw, "circle", sx(x), sy(y), 4, colour)
                drawn[(metric, method, split)] = (sx(x), sy(y))
            for series_line in _series_lines(pts, split).values():  # thinner than the Q-Evolve line
                if len(series_line) > 1:
                    draw.line([(sx(x), sy(y)) for x, y in series_line], fill=colour, width=1)
        for p in pts:
            if not p.on_line:
                _glyph(draw, shapes[p.series or p.method], sx(p.env_steps), sy(p.value), 5, colours[p.split])
                drawn[(metric, p.method, p.split)] = (sx(p.env_steps), sy(p.value))
    entries = [(f"Q-Evolve · {split}", colour, "circle") for split, colour in colours.items()] + \
        [(method, "#777777", shape) for method, shape in shapes.items()]
    x, y = 64.0, float(legend_top + 8)
    for label, colour, shape in entries:
        width_of = draw.textlength(label, font=font) + 34
        if x + width_of > width - 16:
            x, y = 64.0, y + 18
        _glyph(draw, shape, x + 6, y + 6, 5, colour)
        draw.text((x + 16, y + 6), label, fill="black", font=font, anchor="lm")
        x += width_of
    atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))
    return drawn


class Comparison(NamedTuple):
    methods: list[str]  # labels, in display order
    splits: list[str]
    rows: list[dict[str, Any]]  # qevolve compare's rows (or the manifest's metrics without intervals)
    baseline: str
    note: str


def compare_section_data(run_root: Path, stages: list[dict[str, Any]], resamples: int, seed: int,
                         budgets: dict[str, list[int]] | None = None) -> Comparison:
    """The rows of ``qevolve compare`` for this run; when its trajectories cannot be read, the manifest's
    metrics without intervals, and a note saying why. ``budgets``: those of the run's online baselines
    (:func:`qevolve.evaluation.compare.online_budgets`), which name their policies evaluated on the way."""
    from qevolve.evaluation.compare import compare_runs, evaluated_methods, method_name, policy_env_steps

    methods_of = evaluated_methods(stages, budgets or {})
    evals = []  # (method prefix, split, stage): a round's policy once per budget it stands for
    for stage in stages:
        found = _split_of(stage["name"])
        if found is not None:
            evals += [(method, found[1], stage) for method in methods_of.get(found[0], [found[0]])]
    prefixes = _method_order([prefix for prefix, _, _ in evals])
    splits = list(dict.fromkeys(split for _, split, _ in evals))
    methods = [method_name(prefix) for prefix in prefixes]
    baseline = method_name("bc")
    note = (f"Differences are paired by episode against {baseline} (the same tasks), with 95% percentile "
            f"intervals over {resamples:,} bootstrap resamples (seed {seed}), as <code>qevolve compare</code> "
            "computes them.")
    try:
        result = compare_runs([run_root], baseline="bc", resamples=resamples, seed=seed)
        rows = result["rows"]
    except ValueError as error:
        rows = [{"method": method_name(prefix), "split": split, "episodes": s["metrics"].get("episodes"),
                 "success_rate": s["metrics"].get("success_rate"), "mean_reward": s["metrics"].get("mean_reward"),
                 "invalid_action_rate": s["metrics"].get("invalid_action_rate"),
                 "env_steps": policy_env_steps(stages, prefix)} for prefix, split, s in evals]
        note = f"No intervals: {_e(error)}"
    if not any(prefix == "bc" for prefix in prefixes):
        note = "No intervals: the run has no evaluation of the behaviour-cloned policy (bc/eval_&lt;split&gt;) to pair with."
    return Comparison(methods, splits, rows, baseline, note)


def comparison_html(data: Comparison) -> str:
    if not data.rows:
        return "<p>no evaluation stages yet</p>"
    charts = []
    for metric, diff_key in (("success_rate", "success_diff"), ("mean_reward", "reward_diff")):
        values = {(r["method"], r["split"]): r[metric] for r in data.rows if isinstance(r.get(metric), (int, float))}
        diffs = {(r["method"], r["split"]): (r[diff_key], *r[diff_key + "_ci"]) for r in data.rows if diff_key in r}
        charts.append(method_chart(metric, data.methods, data.splits, values, diffs, data.baseline))
    rows = []
    for r in data.rows:
        cells = [_e(r["split"]), _e(r["method"]), fmt_number(r.get("episodes", "")),
                 fmt_number(r["success_rate"]) if r.get("success_rate") is not None else "-",
                 fmt_number(r["mean_reward"]) if r.get("mean_reward") is not None else "-",
                 fmt_number(r["invalid_action_rate"]) if r.get("invalid_action_rate") is not None else "-"]
        for key in ("success_diff", "reward_diff"):
            if key in r:
                lo, hi = r[key + "_ci"]
                cells.append(f"{r[key]:+.3f} [{lo:+.3f}, {hi:+.3f}]")
            else:
                cells.append("-")
        cells.append(f"{r['env_steps']:,.0f}" if r.get("env_steps") is not None else "-")
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    table = (f"<table class='numbers' id='comparison-table'><tr><th>split</th><th>method</th><th>episodes</th>"
             f"<th>success</th><th>mean reward</th><th>invalid actions</th><th>success − {_e(data.baseline)} "
             f"[95% CI]</th><th>reward − {_e(data.baseline)} [95% CI]</th><th>env steps</th></tr>"
             f"{''.join(rows)}</table>")
    return f"<p class='note'>{data.note}</p><div class='plots'>{''.join(charts)}</div>{table}"


# -- training curves ----------------------------------------------------------------------------------

def _thin(points: list[tuple[int, float]], limit: int = MAX_CURVE_POINTS) -> tuple[list[tuple[float, float]], int]:
    """At most ``limit`` points: means of consecutive runs of steps; returns them and the run length."""
    if len(points) <= limit:
        return [(float(x), y) for x, y in points], 1
    size = math.ceil(len(points) / limit)
    out = []
    for start in range(0, len(points), size):
        chunk = points[start:start + size]
        out.append((sum(x for x, _ in chunk) / len(chunk), sum(y for _, y in chunk) / len(chunk)))
    return out, size


def _series_label(tag: str) -> str:
    if tag in SERIES_LABELS:
        return SERIES_LABELS[tag]
    group, _, name = tag.partition("/")
    return f"{name} (held-out)" if group == "eval" else (name or tag)


def _stage_title(name: str) -> str:
    from qevolve.evaluation.compare import method_label

    prefix, _, leaf = name.rpartition("/")
    if name == "bc":
        return "behaviour cloning (SFT)"
    if leaf == "critic":
        return "IQL critic, per epoch" + (f" ({prefix.partition('/')[2]} variant)" if "/" in prefix else "")
    if leaf == "policy" and prefix:
        try:
            return f"policy update: {method_label(prefix)}"
        except (IndexError, ValueError):
            return "policy update"
    return ""


def training_panels(series: dict[str, list[tuple[int, float]]], axis: str) -> tuple[list[str], list[str]]:
    """(the panels of :data:`TRAINING_PANELS` this stage logged, one panel for each other tag)."""
    main, used = [], set()
    for title, tags in TRAINING_PANELS:
        present = [tag for tag in tags if series.get(tag)]
        if not present:
            continue
        used.update(present)
        lines, thinned = [], 1
        for i, tag in enumerate(present):
            points, size = _thin(series[tag])
            thinned = max(thinned, size)
            lines.append(Line(_series_label(tag), SERIES_COLOURS[i % len(SERIES_COLOURS)], points,
                              dots=len(points) <= 30))
        x_label = axis + (f" (means of {thinned} {axis}s)" if thinned > 1 else "")
        if len(present) == 1 and present[0] in SERIES_LABELS:
            title = f"{title} ({SERIES_LABELS[present[0]]})"
        main.append(line_chart(title, lines, x_label=x_label, legend=len(lines) > 1, width=310, height=200,
                               kind="training"))
    more = []
    for tag, points in series.items():
        if tag in used or not points:
            continue
        thinned, size = _thin(points)
        more.append(line_chart(tag, [Line(tag, SERIES_COLOURS[0], thinned, dots=len(thinned) <= 30)],
                               x_label=axis + (f" (means of {size})" if size > 1 else ""), legend=False, width=310,
                               height=200, kind="training"))
    return main, more


def training_html(run_root: Path, stages: list[dict[str, Any]]) -> str:
    from qevolve.scalars import stage_scalars

    blocks = []
    for stage in stages:
        name = stage["name"]
        folder = run_root / name
        if _split_of(name) or not folder.is_dir():
            continue
        try:
            series, axis = stage_scalars(folder)
        except Exception as error:  # noqa: BLE001 - a damaged log must not cost the rest of the report
            blocks.append(f"<h3>{_e(name)}</h3><p class='note'>its training curves could not be read: {_e(error)}</p>")
            continue
        if not series:
            continue
        main, more = training_panels(series, axis)
        title = _stage_title(name)
        steps = max((points[-1][0] for points in series.values() if points), default=0)
        others = sorted(set(series) - {tag for _, tags in TRAINING_PANELS for tag in tags})
        extra = (f"<details class='more'><summary>other curves ({len(more)}): {_e(', '.join(others))}</summary>"
                 f"<div class='plots'>{''.join(more)}</div></details>") if more else ""
        blocks.append(f"<h3 id='training-{_e(name)}'>{_e(name)}{' · ' + _e(title) if title else ''} "
                      f"<span class='note'>({fmt_number(steps)} {axis}{'' if steps == 1 else 's'})</span></h3>"
                      f"<div class='plots'>{''.join(main)}</div>{extra}")
    if not blocks:
        return "<p>no training curves: no stage of this run logged per-step scalars (scalars.jsonl, " \
               "tensorboard/ or a critic's metrics.jsonl)</p>"
    return "".join(blocks)


# -- stage metrics ------------------------------------------------------------------------------------

EVAL_COLUMNS = [("episodes", "episodes"), ("success_rate", "success"), ("mean_reward", "mean reward"),
                ("mean_turns", "turns"), ("format_error_rate", "format errors"),
                ("invalid_action_rate", "invalid actions"), ("failed_episodes", "failed"),
                ("env_steps", "env steps"), ("tokens_generated", "tokens generated")]


def stage_tables(stages: list[dict[str, Any]]) -> str:
    from qevolve.evaluation.compare import method_name

    eval_rows, other_rows = [], []
    for stage in stages:
        found = _split_of(stage["name"])
        metrics = stage.get("metrics", {})
        if found:
            cells = [_e(stage["name"]), _e(method_name(found[0])), _e(found[1])]
            cells += [fmt_number(metrics[key]) if key in metrics else "" for key, _ in EVAL_COLUMNS]
            eval_rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        else:
            chips = " ".join(f"<span class='kv'>{_e(key)} <b>{fmt_number(value)}</b></span>"
                             for key, value in sorted(metrics.items()))
            other_rows.append(f"<tr><td>{_e(stage['name'])}</td><td>{chips}</td></tr>")
    out = ""
    if eval_rows:
        out += ("<h3>evaluations</h3><table class='numbers' id='eval-stages'><tr><th>stage</th><th>method</th>"
                "<th>split</th>" + "".join(f"<th>{_e(title)}</th>" for _, title in EVAL_COLUMNS) + "</tr>"
                + "".join(eval_rows) + "</table>")
    if other_rows:
        out += ("<h3>other stages</h3><table id='stages'><tr><th>stage</th><th>metrics</th></tr>"
                + "".join(other_rows) + "</table>")
    return out or "<p>no stages yet</p>"


# -- trajectories -------------------------------------------------------------------------------------

def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:+.3f}"


def advantage_colour(value: float | None, scale: float) -> str:
    if value is None or scale <= 0:
        return "transparent"
    strength = min(abs(value) / scale, 1.0)
    hue = 130 if value >= 0 else 0
    return f"hsla({hue}, 70%, 45%, {0.15 + 0.6 * strength:.2f})"


def episode_html(ep: Episode, scale: float) -> str:
    """One episode, collapsed: a row per turn; the critic's columns only when the episode has labels."""
    status = "failed" if ep.failed else "won" if ep.won else "lost"
    labelled = any(t.value is not None or t.q_value is not None or t.advantage is not None or t.r_aux is not None
                   for t in ep.turns)
    rows = []
    for t, turn in enumerate(ep.turns):
        if turn.action is None:
            action = f"<span class='bad'>(format error)</span> {_e(turn.agent_text)}"
        else:
            action = _e(turn.action) + ("" if turn.action_valid else " <span class='bad'>(invalid)</span>")
        cells = (f"<td>{t}</td><td class='obs'>{_e(turn.observation)}</td><td class='act'>{action}</td>"
                 f"<td>{turn.reward:g}</td>")
        if labelled:
            cells += (f"<td>{_fmt(turn.r_aux)}</td><td>{_fmt(turn.value)}</td><td>{_fmt(turn.q_value)}</td>"
                      f"<td style='background:{advantage_colour(turn.advantage, scale)}'>{_fmt(turn.advantage)}</td>")
        rows.append(f"<tr>{cells}</tr>")
    header = "<th>t</th><th>observation</th><th>action</th><th>r_env</th>"
    if labelled:
        header += "<th>r_aux</th><th>V</th><th>Q</th><th>process reward</th>"
    failure = f" &middot; {_e(ep.failure_reason)}" if ep.failed and ep.failure_reason else ""
    return (f"<details class='episode {status}'><summary>{_e(ep.task_id)} &middot; {_e(ep.source)} &middot; "
            f"<b>{status}</b> &middot; score {ep.score:.2f} &middot; {ep.num_turns} turns{failure}</summary>"
            f"<table><tr>{header}</tr>{''.join(rows)}</table>"
            f"<p class='final'>final observation: {_e(ep.final_observation)}</p></details>")


def evaluation_trajectories_html(run_root: Path, stages: list[dict[str, Any]], limit: int) -> str:
    from qevolve.evaluation.compare import method_name

    blocks = []
    for stage in stages:
        found = _split_of(stage["name"])
        if not found:
            continue
        folder = run_root / stage.get("outputs", {}).get("trajectories", f"{stage['name']}/trajectories")
        if not (folder.is_dir() and shard_paths(folder)):
            blocks.append(f"<p class='note'>{_e(stage['name'])}: its trajectories ({_e(folder)}) are missing</p>")
            continue
        episodes = sorted(read_episodes(folder), key=lambda ep: ep.episode_id)
        shown = episodes[:limit]
        won = sum(ep.won for ep in episodes)
        more = (f"<p class='note'>showing the first {len(shown)} of {len(episodes)} episodes (by episode id, the "
                f"same tasks in every evaluation); <code>qevolve report --max-eval-episodes N</code> shows more</p>"
                if len(shown) < len(episodes) else "")
        blocks.append(f"<details class='stage-episodes'><summary><b>{_e(stage['name'])}</b> &middot; "
                      f"{_e(method_name(found[0]))} &middot; {_e(found[1])} &middot; {len(episodes)} episodes, "
                      f"{won} won</summary>{more}{''.join(episode_html(ep, 1.0) for ep in shown)}</details>")
    return "".join(blocks) or "<p>no evaluation stages yet</p>"


def labelled_html(run_root: Path, stages: list[dict[str, Any]], limit: int) -> str:
    blocks = []
    for stage in stages:
        labelled = stage.get("outputs", {}).get("labelled")
        if not labelled or not (run_root / labelled).exists():
            continue
        episodes = read_episodes(run_root / labelled)
        advantages = [abs(t.advantage) for ep in episodes for t in ep.turns if t.advantage is not None]
        scale = sorted(advantages)[int(0.95 * (len(advantages) - 1))] if advantages else 1.0
        shown = episodes[:limit]
        note = (f"<p class='note'>showing {len(shown)} of {len(episodes)} episodes; "
                f"<code>qevolve report --max-episodes N</code> shows more</p>" if len(shown) < len(episodes) else "")
        blocks.append(f"<h3>{_e(labelled)} ({len(episodes)} episodes, {len(shown)} shown)</h3>{note}"
                      + "".join(episode_html(ep, scale) for ep in shown))
    return "".join(blocks) or "<p>no labelled buffers yet</p>"


# -- the page -----------------------------------------------------------------------------------------

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em 2em;max-width:1320px;color:#222}
h2{border-bottom:1px solid #ccc;padding-bottom:2px;margin-top:1.6em}h3{margin:1.2em 0 .3em;font-size:15px}
nav a{margin-right:1em}.note{color:#555;font-size:12px;font-weight:normal}
.plots{display:flex;flex-wrap:wrap;gap:6px;align-items:flex-start}
.plot{border:1px solid #ddd;background:#fff}.plot .title{font-weight:600;font-size:12px}
.plot .tick{font-size:10px;fill:#444}.plot .axis,.plot .legend{font-size:11px;fill:#333}.plot .label{font-size:11px}
table{border-collapse:collapse;width:100%;font-size:12px;margin:4px 0}td,th{border:1px solid #ddd;padding:3px;vertical-align:top}
table.numbers td{text-align:right}table.numbers td:nth-child(-n+3){text-align:left}th{background:#f4f4f4}
.kv{display:inline-block;margin:0 10px 2px 0;white-space:nowrap}.kv b{font-weight:600}
td.obs{max-width:560px;white-space:pre-wrap}td.act{font-family:monospace;max-width:380px;white-space:pre-wrap;word-break:break-word}
p.final{font-size:12px;margin:2px 0 8px}.bad{color:#c22}
details{margin:3px 0}details.won>summary b{color:#2a2}details.lost>summary b,details.failed>summary b{color:#c22}
details.stage-episodes{border:1px solid #ddd;padding:4px 8px;margin:6px 0}details.stage-episodes>summary{cursor:pointer}
details.episode{margin-left:1em}code{background:#f4f4f4;padding:0 3px}
"""


def _run_summary(manifest: dict[str, Any]) -> str:
    config = manifest.get("config", {}) or {}
    facts = [("environment", config.get("env")), ("iterations", config.get("iterations")),
             ("baselines", ", ".join(config.get("baselines") or []) or None),
             ("variants", ", ".join(config.get("variants") or {}) or None), ("seed", manifest.get("seed")),
             ("stages done", len(manifest.get("stages", [])))]
    versions = manifest.get("versions", {}) or {}
    version_text = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()))
    return ("<p>" + " ".join(f"<span class='kv'>{_e(k)} <b>{_e(v)}</b></span>" for k, v in facts if v is not None)
            + f"</p><p class='note'>versions: {_e(version_text)}</p>")


def build_report(run_root: str | Path, max_episodes: int = 200, max_eval_episodes: int = 50,
                 resamples: int = 10_000, seed: int = 0) -> Path:
    """Write ``run_root/report.html``; returns its path.

    ``max_episodes``: episodes shown per labelled buffer; ``max_eval_episodes``: per evaluation stage;
    ``resamples`` and ``seed``: the paired bootstrap of the method comparison (those of ``qevolve compare``)."""
    from qevolve.evaluation.compare import online_budgets

    run_root = Path(run_root)
    manifest_path = run_root / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{run_root}: no manifest.json (not a qevolve run directory)")
    manifest = json.loads(manifest_path.read_text())
    stages = manifest.get("stages", [])
    budgets = online_budgets(manifest.get("config"))
    comparison = compare_section_data(run_root, stages, resamples, seed, budgets)
    iterations = iteration_plots(stages, comparison.splits)
    step_points = env_step_points(stages, budgets)
    env_steps = env_steps_plots(step_points, comparison.splits)
    if env_steps:
        write_env_steps_png(step_points, comparison.splits, run_root / ENV_STEPS_PNG)
    sections = [
        ("comparison", "Methods compared", comparison_html(comparison)),
        ("iterations", "Metrics per iteration",
         "<p class='note'>The line is Q-Evolve: the behaviour-cloned policy (BC) at 0, the policy after "
         "iteration k at k. Baselines and variants are the separate markers beside their iteration (legend); "
         "they start from that iteration's policy and buffer and are not part of the line.</p>"
         f"<div class='plots' id='plots'>{iterations}</div>" if iterations else "<p>no evaluation stages yet</p>"),
        ("env-steps", "Success against env steps",
         "<p class='note'>Each evaluated policy at the environment steps of its own interaction: the rollouts "
         "that produced it (BC 0; Q-Evolve iteration k the rollouts of iterations 1 to k; a baseline or variant "
         "of iteration 1 that iteration's rollouts; an online method all of its rounds', and its policies "
         "evaluated on the way, at env-step budgets, those of the rounds up to theirs: they lie on its line). "
         "Expert demonstrations "
         f"and evaluation episodes are not counted. The same plots as an image: <code>{ENV_STEPS_PNG}</code> "
         "beside this page.</p>"
         f"<div class='plots'>{env_steps}</div>" if env_steps else "<p>no evaluation with known env steps yet</p>"),
        ("training", "Training curves",
         "<p class='note'>What each training stage logged per optimizer step (the critic: per epoch). The same "
         f"curves are in TensorBoard: <code>tensorboard --logdir {_e(run_root)}</code>.</p>" + training_html(run_root, stages)),
        ("stage-metrics", "Stage metrics", stage_tables(stages)),
        ("evaluations", "Evaluation trajectories",
         "<p class='note'>Every evaluation stage's episodes, collapsed: open a stage, then an episode.</p>"
         + evaluation_trajectories_html(run_root, stages, max_eval_episodes)),
        ("trajectories", "Labelled buffers",
         "<p class='note'>The buffers the policy update trained on, with the critic's V, Q and the process "
         "reward of every turn (red negative, green positive).</p>"
         f"<div id='labelled'>{labelled_html(run_root, stages, max_episodes)}</div>"),
    ]
    nav = "".join(f"<a href='#{key}'>{_e(title)}</a>" for key, title, _ in sections)
    body = "".join(f"<h2 id='{key}'>{_e(title)}</h2>{content}" for key, title, content in sections)
    page = ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>qevolve run: {_e(run_root.name)}</title><style>{STYLE}</style></head><body>"
            f"<h1>qevolve run: {_e(run_root.name)}</h1>{_run_summary(manifest)}<nav>{nav}</nav>{body}</body></html>")
    out = run_root / "report.html"
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text(page)
    tmp.replace(out)
    return out
