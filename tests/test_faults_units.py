"""Run locking, --redo, resume across a renamed run, relative critic paths, install leftovers,
worker recycling and process-group kills (issue #13, items 3 and 5)."""

from __future__ import annotations

import json
import shutil
import time

import psutil
import pytest

from qevolve.environments.episodes import EpisodeJob
from qevolve.environments.policies import WalkthroughPolicy
from qevolve.environments.pool import EnvPool
from qevolve.evolve.run_dir import RunDirectory, RunError

ENV = "qevolve.environments.testing:CounterEnv"


def writer(text):
    def fn(workdir):
        (workdir / "out.txt").write_text(text)
        return {"file": "out.txt"}, {"n": len(text)}
    return fn


def test_a_second_process_on_a_run_is_refused_until_the_first_ends(tmp_path):
    first = RunDirectory(tmp_path / "r", {"a": 1}, seed=0)
    with pytest.raises(RunError, match=r"\.lock: another qevolve process \(pid \d+\) is running this run"):
        RunDirectory(tmp_path / "r", {"a": 1}, seed=0, resume=True)
    first.run_stage("bc", {}, writer("x"), log=lambda m: None)  # the first one is undisturbed
    first.close()
    with RunDirectory(tmp_path / "r", {"a": 1}, seed=0, resume=True) as again:
        assert again.completed("bc") is not None


def test_redo_forgets_the_stage_and_every_later_one(tmp_path):
    with RunDirectory(tmp_path / "r", {"a": 1}, seed=0) as run:
        for name in ("bc", "iter_1/rollouts", "iter_1/critic"):
            run.run_stage(name, {}, writer(name), log=lambda m: None)
    shutil.rmtree(tmp_path / "r/iter_1/rollouts")  # deleted by hand
    with RunDirectory(tmp_path / "r", {"a": 1}, seed=0, resume=True) as run:
        with pytest.raises(RunError, match=r"iter_1/rollouts/out.txt: recorded .* --redo iter_1/rollouts"):
            run.run_stage("iter_1/rollouts", {}, writer("again"), log=lambda m: None)
    with RunDirectory(tmp_path / "r", {"a": 1}, seed=0, redo="iter_1/rollouts") as run:
        assert [s["name"] for s in run.manifest["stages"]] == ["bc"]
        assert not (tmp_path / "r/iter_1/critic").exists()
        run.run_stage("iter_1/rollouts", {}, writer("again"), log=lambda m: None)
    assert (tmp_path / "r/iter_1/rollouts/out.txt").read_text() == "again"
    lines = (tmp_path / "r/metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["stage"] for line in lines] == ["bc", "iter_1/rollouts"]


def test_a_renamed_run_resumes(tmp_path):
    config = {"name": "a", "runs_dir": str(tmp_path / "runs"), "seed": 0}
    with RunDirectory(tmp_path / "runs/a", config, seed=0) as run:
        run.run_stage("bc", {}, writer("x"), log=lambda m: None)
    (tmp_path / "runs/a").rename(tmp_path / "moved")
    moved = {**config, "name": "moved", "runs_dir": str(tmp_path)}
    with RunDirectory(tmp_path / "moved", moved, seed=0, resume=True) as run:
        assert run.completed("bc").outputs == {"file": "bc/out.txt"}
    with pytest.raises(RunError, match="started with seed=0, this config has seed=1"):
        RunDirectory(tmp_path / "moved", {**moved, "seed": 1}, seed=1, resume=True)


def test_critic_of_a_moved_run_finds_its_backbone(tmp_path):
    from qevolve.critic.config import CriticConfig
    from qevolve.critic.testing import save_tiny_llama, synthetic_buffer
    from qevolve.critic.train import load_critic, train_critic

    run = tmp_path / "runs/a"
    save_tiny_llama(run / "bc/final", seed=0)
    config = CriticConfig.model_validate(dict(init=str(run / "bc/final"), dtype="float32", device="cpu", epochs=1,
                                              batch_tokens=256, feature_cache=False, head_hidden=8))
    train_critic(synthetic_buffer(4, seed=1), config, run / "iter_1/critic", progress=False)
    moved = tmp_path / "elsewhere/b"
    moved.parent.mkdir()
    run.rename(moved)
    critic = load_critic(moved / "iter_1/critic")
    assert critic.init_path == str(moved / "iter_1/critic/../../bc/final")


def test_stale_install_staging_is_removed_by_the_next_install(tmp_path, monkeypatch):
    import hashlib

    from qevolve.data import install as installer

    source = tmp_path / "src"
    (source / "toy").mkdir(parents=True)
    (source / "toy/a.json").write_text("{}")
    digest = hashlib.sha256(b"{}").hexdigest()
    from qevolve.environments import base
    from qevolve.environments.testing import CounterEnv

    toy = type("ToyEnv", (CounterEnv,), {"data_files": (base.DataFile("toy/a.json", digest),)})
    monkeypatch.setitem(base._REGISTRY, "toy", toy)
    root = tmp_path / "data"
    stale = root / ".toy.partial-abc123"
    (stale / "big").mkdir(parents=True)
    other = root / ".alfworld.partial-xyz"  # another dataset's: not ours to remove
    other.mkdir()
    logs = []
    installer.install_dataset("toy", source, root, log=logs.append)
    assert not stale.exists() and other.exists()
    assert any("removed 1 staging folder" in line for line in logs)
    assert installer.is_installed("toy", root)


def test_workers_are_recycled_after_n_episodes(tmp_path):
    jobs = [EpisodeJob(f"count-{1 + i % 3}", WalkthroughPolicy(), split="train", episode_id=f"e{i}")
            for i in range(7)]
    with EnvPool(ENV, num_workers=1, max_episodes_per_worker=3) as pool:
        outcomes = list(pool.run_episodes(jobs))
        assert pool.recycled_workers == 2 and pool.replaced_workers == 0
    assert all(not o.failed and o.episode.won for o in outcomes)
    assert len({o.worker_pid for o in outcomes}) == 3
    assert EnvPool(ENV, num_workers=1).max_episodes_per_worker is None  # no default for this environment
    from qevolve.environments.alfworld.env import AlfWorldEnv

    assert AlfWorldEnv.recycle_workers_after >= 1  # declared by the environment, read by the pool's "auto"


def test_a_killed_worker_takes_its_children_with_it():
    """A worker replaced after a timeout (or closed with the pool) leaves no process behind."""
    pool = EnvPool(ENV, num_workers=1, step_timeout=2.0)
    try:
        pool.reset([(0, "count-3")])
        child = int(pool.step([(0, "spawn")])[0].observation.split()[1])
        assert psutil.pid_exists(child)
        failed = pool.step([(0, "wait 30")])[0]
        assert failed.info.get("failed") and pool.replaced_workers == 1
        deadline = time.monotonic() + 10
        while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
        pool.reset([(0, "count-2")])
        second = int(pool.step([(0, "spawn")])[0].observation.split()[1])
    finally:
        pool.close()
    time.sleep(0.5)
    assert not psutil.pid_exists(second) or psutil.Process(second).status() == psutil.STATUS_ZOMBIE


def test_a_finished_run_extends_with_more_iterations_baselines_and_variants_only(tmp_path):
    from qevolve.evolve.loop import extension_of

    config = {"name": "a", "seed": 0, "iterations": 1, "baselines": ["rft"], "rft": {"lr": 1},
              "eto": {"beta": 0.1}, "variants": {"awr": {"policy": {"objective": "awr"}}}}
    with RunDirectory(tmp_path / "a", config, seed=0) as run:
        run.run_stage("bc", {}, writer("x"), log=lambda m: None)
    wider = {**config, "iterations": 2, "baselines": ["rft", "eto"], "eto": {"beta": 0.5},
             "variants": {**config["variants"], "q_minus_v": {"label": {"estimator": "q_minus_v"}}}}
    with RunDirectory(tmp_path / "a", wider, seed=0, resume=True, extend=extension_of) as run:
        assert run.completed("bc").outputs == {"file": "bc/out.txt"}
    manifest = json.loads((tmp_path / "a/manifest.json").read_text())
    assert manifest["config"] == wider
    assert manifest["extensions"][0]["changes"] == ["iterations 1 -> 2", "baselines + eto", "variants + q_minus_v"]
    # the extended run resumes under its new config as it stands
    with RunDirectory(tmp_path / "a", wider, seed=0, resume=True, extend=extension_of) as run:
        assert len(run.manifest["extensions"]) == 1
    # whatever a recorded stage may have read must still match
    refused = [({**wider, "rft": {"lr": 2}}, "rft.lr=1"),  # a baseline that had already run
               ({**wider, "iterations": 1}, "iterations=2"),  # fewer iterations
               ({**wider, "variants": {"awr": {"policy": {"objective": "ppo"}}, "q_minus_v": {}, "x": {}}},
                "variants.awr.policy.objective=\"awr\""),  # a recorded variant changed
               ({**wider, "baselines": ["eto"]}, "baselines=")]  # a baseline dropped
    for changed, named in refused:
        with pytest.raises(RunError, match=f"started with {named}"):
            RunDirectory(tmp_path / "a", changed, seed=0, resume=True, extend=extension_of)
