"""The HTML run report renders in headless Chromium."""

import shutil
import subprocess

import pytest

from qevolve.buffer.store import write_episodes
from qevolve.evaluation.report import build_report, collect_series
from qevolve.evolve.run_dir import RunDirectory
from test_store import make_episode

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def make_run(tmp_path):
    run = RunDirectory(tmp_path / "demo", {"x": 1}, seed=0)
    for name, rate in [("bc/eval_seen", 0.2), ("bc/eval_unseen", 0.1), ("iter_1/eval_seen", 0.5), ("iter_1/eval_unseen", 0.4)]:
        run.run_stage(name, {}, lambda w, r=rate: ({}, {"success_rate": r, "mean_turns": 10.0}), log=lambda m: None)

    def labelled(workdir):
        episodes = [make_episode(i, n_turns=3, won=i == 0, tokens=True) for i in range(3)]
        for ep in episodes:
            for t, turn in enumerate(ep.turns):
                turn.advantage = 0.5 - 0.4 * t
                turn.observation = "<b>not bold</b> & co"
        write_episodes(workdir / "labelled.parquet", episodes)
        return {"labelled": "labelled.parquet"}, {}

    run.run_stage("iter_1/label", {}, labelled, log=lambda m: None)
    return run.root


def test_series_and_page_content(tmp_path):
    root = make_run(tmp_path)
    import json
    stages = json.loads((root / "manifest.json").read_text())["stages"]
    series = collect_series(stages)
    assert series["success_rate"] == {"seen": [(0, 0.2), (1, 0.5)], "unseen": [(0, 0.1), (1, 0.4)]}
    page = build_report(root).read_text()
    assert page.count("<polyline") == 4  # two metrics x two splits
    assert page.count("<details") == 3
    assert "&lt;b&gt;not bold&lt;/b&gt; &amp; co" in page and "<b>not bold</b>" not in page
    assert "hsla(130" in page and "hsla(0" in page  # positive and negative advantages coloured


@pytest.mark.skipif(CHROMIUM is None, reason="needs the chromium browser (apt-get install chromium); CI installs it")
def test_renders_in_headless_chromium(tmp_path):
    root = make_run(tmp_path)
    page = build_report(root)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "qevolve run: demo" in dom.stdout and dom.stdout.count("<polyline") == 4
    shot = tmp_path / "shot.png"
    result = subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", "--window-size=1200,900", page.as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and shot.stat().st_size > 10_000
