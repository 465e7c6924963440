"""The HTML run report: its content, and its plots as headless Chromium draws them."""

import json
import math
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest

from qevolve.buffer.metrics import episode_metrics
from qevolve.buffer.store import Episode, Turn, write_episodes, write_shard
from qevolve.evaluation.report import build_report, collect_points, collect_series, fmt_number
from qevolve.evolve.run_dir import RunDirectory
from qevolve.scalars import SCALARS_FILE, ScalarLog
from test_store import make_episode

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs the chromium browser (apt-get install chromium); "
                                    "CI installs it")

TASKS = 10
# wins per evaluation (of TASKS tasks): RFT far above Q-Evolve iteration 1, so a line through it would show
WINS = {"bc": {"seen": 2, "unseen": 1}, "iter_1": {"seen": 5, "unseen": 4}, "iter_1/rft": {"seen": 9, "unseen": 8},
        "iter_2": {"seen": 6, "unseen": 5}}


def _evaluation(prefix: str, split: str, wins: int):
    def stage(workdir):
        episodes = []
        for i in range(TASKS):
            won = i < wins
            ep = Episode(f"alfworld/{split}/t{i}#0", f"t{i}", "alfworld", split, "eval", won=won,
                         score=1.0 if won else 0.0, final_observation="done")
            # the splits differ in every metric, so no line of one hides the other's
            unseen = split == "unseen"
            ep.turns = [Turn(observation=f"you see <thing {i}> & more", agent_text="Action: look", action="look",
                             action_valid=i % (2 if unseen else 3) != 0, reward=0.0),
                        Turn(observation="hm", agent_text="I think", action=None, format_valid=False)] * (1 if unseen or i < 2 else 0) \
                + [Turn(observation="ok", agent_text="Action: open", action="open", reward=1.0 if won else 0.0)]
            episodes.append(ep)
        write_shard(workdir / "trajectories", 0, episodes)
        metrics = episode_metrics(episodes)
        metrics["mean_reward"] += 0.123456789e-3  # a long float: the page rounds it
        return {"trajectories": "trajectories"}, metrics
    return stage


def _scalars(values_at, steps):
    def stage(workdir):
        log = ScalarLog(workdir / SCALARS_FILE)
        for step in steps:
            log.write(step, values_at(step))
        log.close()
        return {"policy": "."}, {"steps": len(steps), "last_loss": 0.123456789012345}
    return stage


def _critic(workdir):
    rows = [{"epoch": e, "steps": 4 * e, "loss_v": 0.5 * math.exp(-e / 5) + 0.02, "loss_q": 1.5 * math.exp(-e / 4) + 0.1,
             "v_scored": 0.9 - 0.5 * math.exp(-e / 6), "v_unscored": -0.6 + 0.5 * math.exp(-e / 6), "v_mean": 0.2,
             "explained_variance": 0.8 - 0.9 * math.exp(-e / 5), "seconds": 0.01} for e in range(1, 41)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"critic": "."}, {"explained_variance": rows[-1]["explained_variance"], "converged": 1}


def _labelled(workdir):
    episodes = [make_episode(i, n_turns=3, won=i == 0, tokens=True) for i in range(3)]
    for ep in episodes:
        for t, turn in enumerate(ep.turns):
            turn.advantage = 0.5 - 0.4 * t
            turn.observation = "<b>not bold</b> & co"
    write_episodes(workdir / "labelled.parquet", episodes)
    return {"labelled": "labelled.parquet"}, {"advantage_mean": 0.1}


def make_run(tmp_path):
    """A run directory as the evolve loop writes it: BC, two Q-Evolve iterations, the RFT baseline, with
    per-step scalars, a critic history, evaluation trajectories and a labelled buffer."""
    run = RunDirectory(tmp_path / "demo", {"env": "alfworld", "iterations": 2, "baselines": ["rft"]}, seed=0)
    quiet = {"log": lambda message: None}
    bc_curves = _scalars(lambda s: {"train/loss": 2.0 * math.exp(-s / 8) + 0.1, "train/agent_accuracy":
                                    1.0 - 0.6 * math.exp(-s / 8), "train/lr": 1e-4, "train/tokens_per_second": 900.0,
                                    **({"eval/agent_nll": 2.5 - 0.05 * s} if s % 10 == 0 else {})},
                         range(1, 31))
    run.run_stage("bc", {}, bc_curves, **quiet)
    for split in ("seen", "unseen"):
        run.run_stage(f"bc/eval_{split}", {}, _evaluation("bc", split, WINS["bc"][split]), **quiet)
    run.run_stage("iter_1/critic", {}, _critic, **quiet)
    run.run_stage("iter_1/label", {}, _labelled, **quiet)
    policy_curves = _scalars(lambda s: {"policy/loss": 0.3 - 0.01 * s, "policy/kl_ref": 0.01 * s,
                                        "policy/approx_kl_old": 0.002 * s, "policy/ratio_mean": 1.0,
                                        "policy/ratio_min": 0.8 - 0.01 * s, "policy/ratio_max": 1.2 + 0.02 * s,
                                        "policy/clip_frac_low": 0.02 + 0.001 * s, "policy/clip_frac_high": 0.05 + 0.002 * s},
                             range(1, 21))
    run.run_stage("iter_1/policy", {}, policy_curves, **quiet)
    for prefix in ("iter_1", "iter_1/rft", "iter_2"):
        if prefix == "iter_1/rft":
            run.run_stage("iter_1/rft/policy", {}, _scalars(lambda s: {"train/loss": 0.5 / s}, range(1, 11)), **quiet)
        for split in ("seen", "unseen"):
            run.run_stage(f"{prefix}/eval_{split}", {}, _evaluation(prefix, split, WINS[prefix][split]), **quiet)
    return run.root


def _stages(root):
    return json.loads((root / "manifest.json").read_text())["stages"]


def _svgs(page):
    """(id, kind, parsed element) of every plot of the page."""
    return [(m.group(1), m.group(2), ET.fromstring(m.group(0)))
            for m in re.finditer(r'<svg class="plot" id="([^"]+)" data-kind="([^"]+)".*?</svg>', page, re.S)]


def test_baselines_are_not_on_the_qevolve_line(tmp_path):
    stages = _stages(make_run(tmp_path))
    line = collect_series(stages)["success_rate"]
    assert line == {"seen": [(0, 0.2), (1, 0.5), (2, 0.6)], "unseen": [(0, 0.1), (1, 0.4), (2, 0.5)]}
    assert collect_points(stages)["success_rate"] == {"iter_1/rft": {"seen": (1, 0.9), "unseen": (1, 0.8)}}
    page = build_report(tmp_path / "demo", resamples=200).read_text()
    plot = next(svg for _, kind, svg in _svgs(page) if kind == "iterations" and svg.get("aria-label") == "success rate")
    polylines = plot.findall(".//polyline")
    assert len(polylines) == 2 and all(len(p.get("points").split()) == 3 for p in polylines)
    # RFT: one marker per split, a square (not the line's circles), named in its tooltip and the legend
    rft = [m for m in plot.iter() if m.get("class") == "marker" and "RFT" in (m.findtext("title") or "")]
    assert len(rft) == 2 and all(m.tag == "polygon" for m in rft)
    assert "RFT (iter 1 buffer)" in [t.text for t in plot.iter("text")]
    line_ys = {float(pt.split(",")[1]) for p in polylines for pt in p.get("points").split()}
    assert not line_ys & {float(m.get("data-cy")) for m in rft}


def test_page_content(tmp_path):
    from qevolve.evaluation.compare import compare_runs

    root = make_run(tmp_path)
    page = build_report(root, max_eval_episodes=4, resamples=300).read_text()
    # the comparison: qevolve compare's rows and intervals, as numbers and as bars with whiskers
    rows = {(r["method"], r["split"]): r for r in compare_runs([root], resamples=300)["rows"]}
    rft = rows[("RFT (iter 1 buffer)", "seen")]
    lo, hi = rft["success_diff_ci"]
    assert rft["success_diff"] == pytest.approx(0.7) and f"{rft['success_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]" in page
    methods = [svg for _, kind, svg in _svgs(page) if kind == "methods"]
    assert len(methods) == 2  # success rate and mean reward
    labels = [t.text for t in methods[0].iter("text") if t.get("class") == "label"]
    assert labels == ["SFT (BC)", "Q-Evolve iter 1", "Q-Evolve iter 2", "RFT (iter 1 buffer)"]
    assert len([e for e in methods[0].iter() if e.get("class") == "ci"]) == 6  # 3 methods x 2 splits
    # training curves of every training stage, with the panels a researcher looks for
    for stage, panels in (("bc", ["loss", "agent-token accuracy", "learning rate"]),
                          ("iter_1/critic", ["critic V loss (expectile)", "critic Q loss (TD)", "V by final score (> 0, = 0; not won/lost)",
                                             "explained variance of V (in-sample)"]),
                          ("iter_1/policy", ["loss", "KL divergence", "probability ratio π/π_old", "clip fraction"]),
                          ("iter_1/rft/policy", ["loss"])):
        start = page.index(f"<h3 id='training-{stage}'>")
        block = page[start:page.index("<h3", start + 5)].split("<details class='more'>")[0]
        assert [svg.get("aria-label") for _, _, svg in _svgs(block)] == panels, stage
    assert "other curves (1): train/tokens_per_second" in page
    # stage metrics rounded, not raw JSON
    assert "0.123456789012345" not in page and "0.1235" in page and "last_loss" in page
    assert fmt_number(0.2001234567) == "0.2001" and fmt_number(12345.678) == "12,346" and fmt_number(3) == "3"
    # evaluation trajectories: per stage, collapsed, at most 4 episodes each with a note
    assert page.count("<details class='stage-episodes'>") == 8
    assert page.count("showing the first 4 of 10 episodes") == 8
    assert "you see &lt;thing 1&gt; &amp; more" in page and "<thing" not in page
    assert "<span class='bad'>(invalid)</span>" in page
    assert not re.search(r"<details[^>]*\bopen", page)  # nothing opened by default
    # labelled buffers as before: escaped, advantages coloured both ways
    assert "&lt;b&gt;not bold&lt;/b&gt; &amp; co" in page and "<b>not bold</b>" not in page
    assert "hsla(130" in page and "hsla(0" in page
    # one static file: no script, no external resource
    assert "<script" not in page and not re.search(r"""(src|href)=['"](?!#)""", page) and "url(" not in page


def test_a_run_with_missing_trajectories_still_reports(tmp_path):
    root = make_run(tmp_path)
    shutil.rmtree(root / "iter_2" / "eval_seen" / "trajectories")
    page = build_report(root, resamples=100).read_text()
    assert "No intervals:" in page and "iter_2/eval_seen" in page and "are missing" in page
    assert len([1 for _, kind, _ in _svgs(page) if kind == "methods"]) == 2  # the bars, without whiskers


def test_the_critic_held_out_fit_is_drawn_beside_the_in_sample_one(tmp_path):
    root = make_run(tmp_path)
    history = root / "iter_1" / "critic" / "metrics.jsonl"
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    for row in rows:  # the held-out fit falls as the in-sample one rises (overfitting)
        # heldout_v_success: a metric's name before the v_scored rename, read under today's name
        row.update(heldout_explained_variance=0.2 - 0.01 * row["epoch"], heldout_v_success=0.5)
    history.write_text("".join(json.dumps(row) + "\n" for row in rows))
    page = build_report(root, resamples=100).read_text()
    start = page.index("<h3 id='training-iter_1/critic'>")
    block = page[start:page.index("<h3", start + 5)]
    main = block.split("<details class='more'>")[0]
    plots = {svg.get("aria-label"): svg for _, _, svg in _svgs(main)}
    assert "explained variance of V (in-sample)" not in plots
    panel = plots["explained variance of V"]
    assert [t.text for t in panel.iter("text") if t.get("class") == "legend"] == ["in-sample", "held-out"]
    polylines = panel.findall(".//polyline")
    assert len(polylines) == 2 and all(len(p.get("points").split()) == len(rows) for p in polylines)
    assert "other curves (1): critic/heldout_v_scored" in block  # the other held-out numbers: collapsed


def test_the_critic_kfold_curve_is_drawn_with_the_other_explained_variances(tmp_path):
    root = make_run(tmp_path)
    epochs = len((root / "iter_1" / "critic" / "metrics.jsonl").read_text().splitlines())
    curve = [{"epoch": e + 1, "explained_variance_ema": 0.1 + 0.01 * e, "explained_variance_last": 0.0,
              "auc_won_vs_lost_ema": 0.6, "auc_won_vs_lost_last": 0.5} for e in range(epochs)]
    (root / "iter_1" / "critic" / "kfold.json").write_text(json.dumps({"label_value": "ema", "curve": curve}))
    page = build_report(root, resamples=100).read_text()
    start = page.index("<h3 id='training-iter_1/critic'>")
    main = page[start:page.index("<h3", start + 5)].split("<details class='more'>")[0]
    plots = {svg.get("aria-label"): svg for _, _, svg in _svgs(main)}
    panel = plots["explained variance of V"]
    assert [t.text for t in panel.iter("text") if t.get("class") == "legend"] == ["in-sample", "k-fold held-out"]
    assert "AUC of V(s_0), won vs lost (held out)" in plots
    from qevolve.scalars import stage_scalars

    series, axis = stage_scalars(root / "iter_1" / "critic")  # the ema curve: the V the labels read
    assert axis == "epoch" and series["critic/kfold_explained_variance"][-1] == (epochs, curve[-1]["explained_variance_ema"])


def _chromium(tmp_path, *args):
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--hide-scrollbars", "--force-device-scale-factor=1", f"--user-data-dir={tmp_path / 'profile'}"]
    result = subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def _rgb(colour):
    return tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))


def _near(image, x, y, colour, radius=2, tolerance=40):
    """Whether a pixel within ``radius`` of (x, y) has ``colour`` (each channel within ``tolerance``)."""
    target = _rgb(colour) if isinstance(colour, str) else colour
    for dx in range(-radius, radius + 1):
        for dy in range(-radius, radius + 1):
            px, py = int(round(x)) + dx, int(round(y)) + dy
            if 0 <= px < image.width and 0 <= py < image.height and \
                    max(abs(a - b) for a, b in zip(image.getpixel((px, py)), target)) <= tolerance:
                return True
    return False


def _drawn(element, shift=0.0):
    """The elements under ``element`` with the vertical shift of the <g transform="translate(0 Y)"> around them."""
    match = re.match(r"translate\(0 ([-\d.]+)\)", element.get("transform", ""))
    shift += float(match.group(1)) if match else 0.0
    yield element, shift
    for child in element:
        yield from _drawn(child, shift)


def _check_plot(image, svg, left, top):
    """What a plot draws is on the screenshot where it says: bars in their colour, every whisker dark,
    most vertices of every line in the line's colour, every marker's centre and legend swatch in its colour.
    Returns the number of data elements (bars, lines, markers) checked: a plot without any fails."""
    checked = 0
    name = svg.get("aria-label")
    for element, shift in _drawn(svg):
        kind = element.get("class")
        if kind == "bar":
            x, y, w, h = (float(element.get(k)) for k in ("x", "y", "width", "height"))
            inside = [(left + x + i, top + y + j) for i in range(int(w)) for j in range(1, int(h) - 1)]
            hits = sum(_near(image, px, py, element.get("fill"), radius=0) for px, py in inside)
            assert hits >= 0.3 * len(inside) > 0, (name, "bar", element.attrib)
        elif kind == "ci":
            x1, x2, y = float(element.get("x1")), float(element.get("x2")), float(element.get("y1"))
            samples = [x1 + (x2 - x1) * f for f in (0.02, 0.25, 0.5, 0.75, 0.98)]
            assert all(_near(image, left + x, top + y, (34, 34, 34), radius=1, tolerance=90) for x in samples), \
                (name, "whisker", element.attrib)
        elif kind == "series":
            vertices = [tuple(map(float, p.split(","))) for p in element.get("points").split()]
            hits = sum(_near(image, left + x, top + y, element.get("stroke")) for x, y in vertices)
            assert hits >= 0.8 * len(vertices), (name, "line", element.get("stroke"), hits, len(vertices))
        elif kind in ("marker", "legend-marker"):
            x, y = float(element.get("data-cx")), float(element.get("data-cy")) + shift
            assert _near(image, left + x, top + y, element.get("fill"), radius=1), (name, kind, element.attrib)
        elif kind == "legend-swatch":
            if element.tag == "rect":
                x, y = float(element.get("x")) + 8, float(element.get("y")) + 5 + shift
            else:
                x, y = float(element.get("x1")) + 8, float(element.get("y1")) + shift
            colour = element.get("fill") or element.get("stroke")
            assert _near(image, left + x, top + y, colour, radius=1), (name, kind, element.attrib)
        checked += kind in ("bar", "series", "marker")
    return checked


@needs_chromium
def test_plots_have_their_elements_in_headless_chromium(tmp_path):
    """Chromium draws the report; every plot, cut out of a screenshot where the test placed it, shows its
    bars, whiskers, lines, markers and legend in their colours."""
    from PIL import Image

    root = make_run(tmp_path)
    page_path = build_report(root, resamples=300)
    page = page_path.read_text()

    # the page itself: Chromium parses it whole, and its top (the comparison) is drawn in colour
    dom = _chromium(tmp_path, "--dump-dom", page_path.as_uri()).stdout
    assert "qevolve run: demo" in dom and dom.count('class="plot"') == page.count('class="plot"') >= 20
    shot = tmp_path / "page.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,1400", page_path.as_uri())
    image = Image.open(shot).convert("RGB")
    colours = image.getcolors(maxcolors=1 << 20)
    blue = sum(count for count, rgb in colours if max(abs(a - b) for a, b in zip(rgb, (31, 119, 180))) <= 10)
    red = sum(count for count, rgb in colours if max(abs(a - b) for a, b in zip(rgb, (214, 39, 40))) <= 10)
    assert blue > 500 and red > 500, (blue, red)  # the split colours of the bars

    # every plot at a known place: the same page, with a style that hides all but the plots and lays them
    # out on a grid (no script needed), so each plot's pixels can be checked against its own markup
    plots = _svgs(page)
    placed, x, y, row = [], 0, 0, 0
    for plot_id, kind, svg in plots:
        width, height = int(float(svg.get("width"))), int(float(svg.get("height")))
        if x and x + width > 1600:
            x, y, row = 0, y + row + 10, 0
        placed.append((plot_id, svg, x, y))
        x, row = x + width + 10, max(row, height)
    style = ("<style>body{margin:0}body *{visibility:hidden}svg.plot,svg.plot *{visibility:visible}"
             "svg.plot{position:absolute;border:0;margin:0}"
             + "".join(f"#{plot_id}{{left:{px}px;top:{py}px}}" for plot_id, _, px, py in placed) + "</style>")
    grid = tmp_path / "grid.html"
    grid.write_text(page.replace("</head>", style + "</head>").replace("<details", "<details open"))
    shot = tmp_path / "grid.png"
    _chromium(tmp_path, f"--screenshot={shot}", f"--window-size=1600,{y + row + 10}", grid.as_uri())
    image = Image.open(shot).convert("RGB")
    kinds = {}
    for plot_id, svg, px, py in placed:
        assert _check_plot(image, svg, px, py) > 0, f"{svg.get('aria-label')}: nothing drawn"
        kinds[svg.get("data-kind")] = kinds.get(svg.get("data-kind"), 0) + 1
    assert kinds["methods"] == 2 and kinds["iterations"] == 5 and kinds["training"] >= 12, kinds

    # the check tells plots apart: an iteration plot's markup against the pixels of a training plot fails
    iterations = next(svg for _, svg, _, _ in placed if svg.get("data-kind") == "iterations")
    px, py = next((px, py) for _, svg, px, py in placed if svg.get("data-kind") == "training")
    with pytest.raises(AssertionError):
        _check_plot(image, iterations, px, py)


def test_cli_report_writes_the_page_and_refuses_a_non_run(tmp_path):
    from typer.testing import CliRunner

    from qevolve.cli import app

    root = make_run(tmp_path)
    result = CliRunner().invoke(app, ["report", str(root), "--max-eval-episodes", "3"])
    assert result.exit_code == 0, result.output
    assert "showing the first 3 of 10 episodes" in (root / "report.html").read_text()
    bad = CliRunner().invoke(app, ["report", str(tmp_path / "nowhere")])
    # raised to `qevolve`'s entry point, which prints it as one line (the runner calls the app directly)
    assert isinstance(bad.exception, FileNotFoundError) and "no manifest.json" in str(bad.exception)


def test_success_against_env_steps_is_drawn_on_the_page_and_in_a_png(tmp_path):
    """Each evaluated policy sits at the env steps of its own interaction: BC at 0, Q-Evolve iteration k at
    the rollouts of iterations 1..k, RFT (iteration 1's buffer) at iteration 1's rollouts."""
    from PIL import Image

    from qevolve.evaluation.report import ENV_STEPS_PNG, env_step_points

    run = RunDirectory(tmp_path / "steps", {"env": "alfworld", "iterations": 2, "baselines": ["rft"]}, seed=0)
    quiet = {"log": lambda message: None}

    def rollouts(steps):
        return lambda workdir: ({}, {"env_steps": steps})

    run.run_stage("bc/eval_seen", {}, _evaluation("bc", "seen", WINS["bc"]["seen"]), **quiet)
    run.run_stage("iter_1/rollouts", {}, rollouts(120), **quiet)
    run.run_stage("iter_1/eval_seen", {}, _evaluation("iter_1", "seen", WINS["iter_1"]["seen"]), **quiet)
    run.run_stage("iter_1/rft/eval_seen", {}, _evaluation("iter_1/rft", "seen", WINS["iter_1/rft"]["seen"]), **quiet)
    run.run_stage("iter_2/rollouts", {}, rollouts(80), **quiet)
    run.run_stage("iter_2/eval_seen", {}, _evaluation("iter_2", "seen", WINS["iter_2"]["seen"]), **quiet)
    points = env_step_points(_stages(run.root))
    success = {(p.method, p.on_line): (p.env_steps, p.value) for p in points["success_rate"]}
    assert success == {("SFT (BC)", True): (0, 0.2), ("Q-Evolve iter 1", True): (120, 0.5),
                       ("RFT (iter 1 buffer)", False): (120, 0.9), ("Q-Evolve iter 2", True): (200, 0.6)}

    page = build_report(run.root).read_text()
    plots = [svg for _, kind, svg in _svgs(page) if kind == "env-steps"]
    assert len(plots) == 2  # success and mean reward
    image = Image.open(run.root / ENV_STEPS_PNG).convert("RGB")
    assert image.size == (960, 420)
    from qevolve.evaluation.report import write_env_steps_png

    drawn = write_env_steps_png(points, ["seen"], tmp_path / "again.png")
    assert Image.open(tmp_path / "again.png").convert("RGB").tobytes() == image.tobytes()  # the same drawing
    for (metric, method, split), (x, y) in drawn.items():  # every point is drawn in its split's colour
        assert _near(image, x, y, "#1f77b4"), (metric, method, x, y)
    bc, k2 = drawn[("success_rate", "SFT (BC)", "seen")], drawn[("success_rate", "Q-Evolve iter 2", "seen")]
    rft = drawn[("success_rate", "RFT (iter 1 buffer)", "seen")]
    k1 = drawn[("success_rate", "Q-Evolve iter 1", "seen")]
    assert bc[0] < k1[0] == rft[0] < k2[0] and rft[1] < k1[1]  # more env steps right, more success up


def test_an_online_baselines_budgets_lie_on_its_line_in_the_env_steps_plot(tmp_path):
    """GRPO evaluated at the budgets 100 and 250 on the way (grpo.evaluate_at_env_steps): its points are named
    by the budget, sit at the steps of the rounds up to the one that reached it, and form the GRPO line with
    its last policy, drawn between them in the PNG; the methods table has their rows."""
    from PIL import Image

    from qevolve.evaluation.compare import online_budgets
    from qevolve.evaluation.report import ENV_STEPS_PNG, env_step_points

    config = {"env": "alfworld", "iterations": 1, "baselines": ["grpo"],
              "grpo": {"evaluate_at_env_steps": [100, 250]}}
    run = RunDirectory(tmp_path / "budgets", config, seed=0)
    quiet = {"log": lambda message: None}

    def rollouts(steps):
        return lambda workdir: ({}, {"env_steps": steps})

    wins = {"bc": 2, "iter_1": 5, "iter_1/grpo/round_1": 3, "iter_1/grpo/round_3": 6, "iter_1/grpo": 8}
    run.run_stage("bc/eval_seen", {}, _evaluation("bc", "seen", wins["bc"]), **quiet)
    run.run_stage("iter_1/rollouts", {}, rollouts(40), **quiet)
    run.run_stage("iter_1/eval_seen", {}, _evaluation("iter_1", "seen", wins["iter_1"]), **quiet)
    for r in range(1, 5):
        run.run_stage(f"iter_1/grpo/round_{r}/rollouts", {}, rollouts(120 if r == 1 else 70), **quiet)
        if f"iter_1/grpo/round_{r}" in wins:  # round 1 reaches 100 steps (120), round 3 reaches 250 (260)
            prefix = f"iter_1/grpo/round_{r}"
            run.run_stage(f"{prefix}/eval_seen", {}, _evaluation(prefix, "seen", wins[prefix]), **quiet)
    run.run_stage("iter_1/grpo/eval_seen", {}, _evaluation("iter_1/grpo", "seen", wins["iter_1/grpo"]), **quiet)
    manifest = json.loads((run.root / "manifest.json").read_text())
    assert online_budgets(manifest["config"]) == {"grpo": [100, 250]}
    points = env_step_points(manifest["stages"], online_budgets(manifest["config"]))["success_rate"]
    assert {(p.method, p.series): (p.env_steps, p.value) for p in points if not p.on_line} == {
        ("GRPO at 100 env steps", "GRPO"): (120, 0.3), ("GRPO at 250 env steps", "GRPO"): (260, 0.6),
        ("GRPO", "GRPO"): (330, 0.8)}

    page = build_report(run.root).read_text()
    methods = page[page.index("id='comparison-table'"):]
    methods = methods[:methods.index("</table>")]
    assert "GRPO at 100 env steps" in methods and "GRPO at 250 env steps" in methods
    assert "after round" not in methods  # the rounds' own stages keep their round in the stage tables
    plots = [svg for _, kind, svg in _svgs(page) if kind == "env-steps"]
    assert len(plots) == 2
    image = Image.open(run.root / ENV_STEPS_PNG).convert("RGB")
    from qevolve.evaluation.report import write_env_steps_png

    drawn = write_env_steps_png(env_step_points(manifest["stages"], {"grpo": [100, 250]}), ["seen"],
                                tmp_path / "again.png")
    assert Image.open(tmp_path / "again.png").convert("RGB").tobytes() == image.tobytes()
    first, second = drawn[("success_rate", "GRPO at 100 env steps", "seen")], drawn[("success_rate",
                                                                                     "GRPO at 250 env steps", "seen")]
    middle = ((first[0] + second[0]) / 2, (first[1] + second[1]) / 2)
    assert _near(image, *middle, "#1f77b4", radius=1)  # the GRPO line between its two budgets
