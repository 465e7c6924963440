"""Shared fixtures: installed data, a tiny local model (no download), real ALFWorld expert episodes, and the
runs of the online baselines' tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qevolve.data.install import install, is_installed
from qevolve.paths import shared_data_dir


def pytest_configure(config):
    """Tiny models run fastest on one thread: with their small matrices, thread synchronisation
    dominates, and on a shared machine a busy second core makes it 10-50x slower (measured here)."""
    import os

    import torch

    torch.set_num_threads(1)
    # `agent.backend: auto` means hf in tests (subprocesses inherit it), whether or not vLLM is
    # installed: tests of the vLLM backend ask for it by name (a vLLM engine start costs a minute).
    os.environ.setdefault("QEVOLVE_AUTO_BACKEND", "hf")


def ensure_installed(name: str) -> None:
    if not is_installed(name):
        if shared_data_dir() is None:
            pytest.fail(f"{name} data is not installed and ../shared/data is missing: run `qevolve data install {name}`")
        install([name])


@pytest.fixture(scope="session")
def benchmark_module():
    """Import a script of benchmarks/ by name (``benchmark_module("attention_kernels")``), as the script sees
    its own folder, without leaving that folder on ``sys.path``."""
    import importlib
    import sys

    folder = str(Path(__file__).resolve().parents[1] / "benchmarks")

    def load(name: str):
        sys.path.insert(0, folder)
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(folder)

    return load


@pytest.fixture(scope="session")
def alfworld_installed():
    """The real ALFWorld games, installed from ../shared/data into the data directory once."""
    ensure_installed("alfworld")
    return True


@pytest.fixture(scope="session")
def webshop_installed():
    """The real WebShop data, installed from ../shared/data into the data directory once."""
    ensure_installed("webshop")
    return True


@pytest.fixture(scope="session")
def all_data_installed():
    """ALFWorld, WebShop and the ScienceWorld task lists, installed once."""
    for name in ("alfworld", "webshop", "sciworld"):
        ensure_installed(name)
    return True


@pytest.fixture(scope="session")
def tiny_critic_init(tmp_path_factory) -> Path:
    """A tiny randomly initialised Llama (seed 0) for critic tests (see qevolve.critic.testing)."""
    from qevolve.critic.testing import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-critic") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE tokeniser with ChatML tokens and template (see qevolve.models.testing)."""
    from qevolve.models.testing import tiny_tokenizer as build

    return build()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny randomly initialised Llama model + tokeniser saved in Hugging Face format."""
    from qevolve.models.testing import save_tiny_policy

    return save_tiny_policy(tmp_path_factory.mktemp("tiny-policy") / "model")


@pytest.fixture(scope="session")
def alfworld_experts(alfworld_installed):
    """Four real ALFWorld expert trajectories, replayed in the environment (train split, won)."""
    from qevolve.environments.alfworld import alfworld_expert_jobs
    from qevolve.environments.play import play_jobs

    jobs, _ = alfworld_expert_jobs(split="train", limit=4)
    result = play_jobs("alfworld", jobs, split="train", num_workers=2, progress=False)
    episodes = [ep for ep in result.episodes if ep.won]
    assert len(episodes) >= 3, f"expected won expert episodes, got {result.metrics}"
    return sorted(episodes, key=lambda ep: ep.episode_id)


@pytest.fixture(autouse=True)
def _environment_specs_forgotten():
    """Environments a test loads by 'module:name' are forgotten after it (the next lookup loads them again):
    otherwise they stay registered in the process and appear in later tests' 'unknown environment' lists.
    Plain names registered by importing a module stay, since a second import would not register them again."""
    from qevolve.environments import base

    before = set(base._REGISTRY)
    yield
    for name in set(base._REGISTRY) - before:
        if ":" in name:
            del base._REGISTRY[name]


CHOICE_ENV = "qevolve.environments.testing:ChoiceEnv"


@pytest.fixture(scope="session")
def choice_run_overrides(tmp_path_factory, tiny_model_dir) -> list[str]:
    """The settings the online baselines' tests share, on the one-decision ``ChoiceEnv`` (say ``right`` of
    left/right/up): BC on every direction of every task (won and lost alike: a policy that says each about
    equally often), then K = 1 with the outcome labels (no critic). Each test adds its baseline's settings."""
    from qevolve.buffer.store import write_episodes
    from qevolve.environments.episodes import EpisodeJob
    from qevolve.environments.play import play_jobs
    from qevolve.environments.policies import ReplayPolicy

    folder = tmp_path_factory.mktemp("choice")
    jobs = [EpisodeJob(f"choice-{n}", ReplayPolicy([d]), split="train", episode_id=f"expert/{n}/{d}")
            for n in range(8) for d in ("left", "right", "up")]
    experts = folder / "experts.parquet"
    write_episodes(experts, play_jobs(CHOICE_ENV, jobs, split="train", num_workers=1, progress=False).episodes)
    return [
        f"env={CHOICE_ENV}", "iterations=1", "progress=false", "num_threads=1", "tensorboard=false", "seed=0",
        f"model.name_or_path={tiny_model_dir}", "model.precision=fp32", "model.device=cpu", "model.lora.enabled=false",
        "prompt.max_prompt_tokens=256", "prompt.reserve_action_tokens=8",
        f"bc.data.train_path={experts}", "bc.data.only_won=false", "bc.max_steps=150", "bc.optim.lr=1e-2",
        "bc.grad_accum_steps=1", "bc.tokens_per_batch=4096", "bc.tensorboard=false",
        "rollout.agent.max_new_tokens=8", "rollout.agent.num_workers=1",
        "eval.splits=[seen]", "eval.agent.max_new_tokens=8", "eval.agent.num_workers=1",
        f"buffer.expert_path={experts}", "buffer.num_expert=2", "label.estimator=outcome", "probe.states=0",
        "policy.max_steps=1", "policy.grad_accum_steps=1", "policy.tokens_per_batch=4096", "policy.tensorboard=false",
    ]


@pytest.fixture
def killed_in_round_2_and_resumed(monkeypatch):
    """``run(config, baseline) -> (run folder, messages)``: runs ``config`` and kills it inside round 2's policy
    update of the online baseline ``baseline`` (at step 3, after its checkpoint at step 2), checks that the
    manifest then ends with that round's labels, resumes it, and checks that the update continued from the
    checkpoint; the messages are the resumed run's."""
    from qevolve.evolve.loop import run_evolve
    from qevolve.training.trainer import Trainer

    def run(config, baseline: str) -> tuple[Path, list[str]]:
        real_finish = Trainer.finish_step
        killed: list[int] = []

        def finish_step(trainer, stage, step, *args, **kwargs):
            if ".policy.partial" in str(trainer.output_dir) and "round_2" in str(trainer.output_dir) and step == 3 \
                    and not killed:
                killed.append(step)
                raise KeyboardInterrupt("killed inside round 2's update")
            return real_finish(trainer, stage, step, *args, **kwargs)

        monkeypatch.setattr(Trainer, "finish_step", finish_step)
        with pytest.raises(KeyboardInterrupt):
            run_evolve(config, log=lambda m: None)
        root = Path(config.runs_dir) / config.name
        stages = json.loads((root / "manifest.json").read_text())["stages"]
        assert stages[-1]["name"] == f"iter_1/{baseline}/round_2/label" and killed == [3]
        messages: list[str] = []
        run_evolve(config, resume=True, log=messages.append)
        assert any("policy: resumed from" in m and "at step 2" in m for m in messages)
        return root, messages

    return run


@pytest.fixture(scope="session")
def counter_experts(tmp_path_factory) -> Path:
    """The counter testing environment's expert episodes (tests of `qevolve evolve` under torch's launcher)."""
    from evolve_launch import ENV

    from qevolve.testing import write_expert_demonstrations

    return write_expert_demonstrations(ENV, tmp_path_factory.mktemp("dist-evolve") / "experts.parquet")


@pytest.fixture(scope="session")
def evolve_reference_run(counter_experts, tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny run of tests/evolve_launch.py in the evolve process (every stage in one process): what the
    launched runs are compared with."""
    from evolve_launch import tiny_config

    from qevolve.evolve.loop import run_evolve

    runs = tmp_path_factory.mktemp("in-process")
    run_evolve(tiny_config(runs, counter_experts, tiny_model_dir), log=lambda line: None)
    return runs / "run"
