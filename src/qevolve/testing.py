"""Helpers for trying the pipeline on a new environment in seconds, and for testing code built on it.

:func:`save_tiny_model` writes a tiny randomly initialised causal LM with its tokeniser (a Llama
architecture with a ChatML chat template, like the default policy, but about 1 MB) in Hugging Face
format. Any stage takes the folder as ``model.name_or_path``; ``qevolve model tiny FOLDER`` writes
the same from the command line. It learns nothing useful: it is for checking that an environment,
its demonstrations and a config run end to end (docs/own-environment.md), not for results.

:class:`CounterEnv` is the smallest complete environment (``qevolve.testing:CounterEnv``).

:func:`write_expert_demonstrations` plays a testing environment's scripted expert on every task and
:func:`tiny_evolve_overrides` gives the config of a whole ``qevolve evolve`` loop (BC, one iteration,
the rft baseline) that runs on such demonstrations with a tiny model in about a minute on a CPU: the
tests and the GPU check (benchmarks/gpu_check.py) run the loop with them.
"""

from __future__ import annotations

from pathlib import Path

from qevolve.environments.testing import CounterEnv

__all__ = ["CounterEnv", "QUIET_COUNTER", "save_tiny_model", "tiny_evolve_overrides", "write_expert_demonstrations"]

#: the counter without process ids in its observations: a run twice sees the same text
QUIET_COUNTER = "qevolve.environments.testing:QuietCounterEnv"


def save_tiny_model(folder: str | Path, seed: int = 0) -> Path:
    """Write a tiny random model and its tokeniser to ``folder`` (created); return the folder."""
    from qevolve.models.testing import save_tiny_policy

    return save_tiny_policy(Path(folder).expanduser(), seed=seed)


def write_expert_demonstrations(env: str, path: str | Path, split: str = "train") -> Path:
    """Play every task of ``env``'s ``split`` with its scripted expert (the environment's ``expert_actions``) and
    write the episodes to ``path`` (a Parquet trajectory store); return the path."""
    from qevolve.buffer.store import write_episodes
    from qevolve.environments.episodes import EpisodeJob
    from qevolve.environments.play import play_jobs
    from qevolve.environments.policies import WalkthroughPolicy
    from qevolve.environments.base import make_environment

    tasks = make_environment(env, split=split).tasks(split)
    jobs = [EpisodeJob(task, WalkthroughPolicy(), split=split, episode_id=f"expert/{task}") for task in tasks]
    path = Path(path)
    write_episodes(path, play_jobs(env, jobs, split=split, num_workers=1, progress=False).episodes)
    return path


def tiny_evolve_overrides(runs_dir: str | Path, experts: str | Path, model_dir: str | Path, env: str = QUIET_COUNTER,
                          name: str = "run", device: str = "cpu", backend: str = "auto") -> list[str]:
    """KEY=VALUE overrides of a whole tiny evolve loop (``load_config(EvolveConfig, None, overrides)``): BC on
    ``experts``, one iteration (rollouts, buffer, critic, labels, policy update), the rft baseline, every
    policy probed on 2 states and evaluated on 2 seen tasks; every stage a few steps of ``model_dir``'s model
    on ``device``, generation with ``backend`` (auto, hf or vllm) in fp32 and on 1 thread."""
    # 2 micro-batches a step (about one sequence each): with 2 processes each rank takes one
    train = ("max_steps=2", "grad_accum_steps=2", "tokens_per_batch=256", "tensorboard=false", "save_every=1")
    return [
        f"env={env}", f"name={name}", f"runs_dir={runs_dir}", "iterations=1", "baselines=[rft]", "progress=false",
        "num_threads=1", "tensorboard=false", "seed=3",
        f"model.name_or_path={model_dir}", "model.precision=fp32", f"model.device={device}",
        "prompt.max_prompt_tokens=512", "prompt.reserve_action_tokens=16", f"bc.data.train_path={experts}",
        *(f"{section}.{item}" for section in ("bc", "policy", "rft") for item in train),
        "rollout.limit=2", "rollout.agent.max_turns=3", "rollout.agent.max_new_tokens=8",
        f"rollout.agent.backend={backend}", f"eval.agent.backend={backend}",
        "eval.splits=[seen]", "eval.limit=2", "eval.agent.max_turns=2", "eval.agent.max_new_tokens=8",
        f"buffer.expert_path={experts}", "critic.epochs=1", "critic.feature_cache=false", "critic.head_hidden=16",
        f"critic.device={device}", "critic.retrospective.enabled=false", "critic.checkpoint_every_steps=1",
        "critic.diagnostics.folds=0", "probe.states=0",
    ]
