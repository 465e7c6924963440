"""Shared fixtures: a tiny local model (no download) and a handful of real ALFWorld expert episodes."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_configure(config):
    """Tiny models run fastest on one thread: with their small matrices, thread synchronisation
    dominates, and on a shared machine a busy second core makes it 10-50x slower (measured here)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE tokeniser with ChatML tokens and template (see qevolve.policy.testing)."""
    from qevolve.policy.testing import tiny_tokenizer as build

    return build()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny randomly initialised Llama model + tokeniser saved in Hugging Face format."""
    from qevolve.policy.testing import save_tiny_policy

    return save_tiny_policy(tmp_path_factory.mktemp("tiny-policy") / "model")


@pytest.fixture(scope="session")
def alfworld_experts():
    """Four real ALFWorld expert trajectories, replayed in the environment (train split, won)."""
    from qevolve.environments.alfworld import alfworld_expert_jobs
    from qevolve.environments.play import play_jobs

    jobs, _ = alfworld_expert_jobs(split="train", limit=4)
    result = play_jobs("alfworld", jobs, split="train", num_workers=2, progress=False)
    episodes = [ep for ep in result.episodes if ep.won]
    assert len(episodes) >= 3, f"expected won expert episodes, got {result.metrics}"
    return sorted(episodes, key=lambda ep: ep.episode_id)
