"""An interrupted training stage continues from its last checkpoint on ``--resume`` and ends at the same
weights as an uninterrupted run: behaviour cloning, the critic, BPPO and the RFT and ETO (DPO) baselines;
and ``qevolve evolve`` stopped by SIGINT or SIGTERM names the stage and the command that continues it.

The loop runs in-process on the counter testing environment with a tiny random LoRA model (K = 1,
baselines rft and eto). Each training stage is interrupted in turn, at a seeded step, by a
KeyboardInterrupt raised where its optimizer step would run (as Ctrl-C raises it between two
Python operations), after a checkpoint of an earlier step: the next ``--resume`` must start there.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from qevolve.buffer.store import write_episodes
from qevolve.config import load_config
from qevolve.evolve.loop import EvolveConfig, run_evolve

ENV = "qevolve.environments.testing:QuietCounterEnv"
SRC = Path(__file__).resolve().parents[1] / "src"
POLICY_STAGES = ["bc", "iter_1/policy", "iter_1/rft/policy", "iter_1/eto/policy"]
TRAINING_STAGES = ["bc", "iter_1/critic", "iter_1/policy", "iter_1/rft/policy", "iter_1/eto/policy"]
STEPS, SAVE_EVERY = 5, 2  # every policy trainer: steps, and a checkpoint every SAVE_EVERY of them


@pytest.fixture(scope="module")
def overrides(tmp_path_factory, tiny_model_dir):
    from qevolve.environments.play import play_jobs
    from qevolve.environments.policies import WalkthroughPolicy
    from qevolve.environments.episodes import EpisodeJob

    folder = tmp_path_factory.mktemp("resume-stages")
    jobs = [EpisodeJob(f"count-{n}", WalkthroughPolicy(), split="train", episode_id=f"expert/{n}")
            for n in range(1, 6)]
    experts = folder / "experts.parquet"
    write_episodes(experts, play_jobs(ENV, jobs, split="train", num_workers=1, progress=False).episodes)
    trainer = [f"max_steps={STEPS}", "grad_accum_steps=1", "tensorboard=false", f"save_every={SAVE_EVERY}"]
    return [
        f"env={ENV}", "iterations=1", "progress=false", "num_threads=1", "tensorboard=false", "seed=3",
        f"model.name_or_path={tiny_model_dir}", "model.precision=fp32", "model.device=cpu",
        "prompt.max_prompt_tokens=512", "prompt.reserve_action_tokens=16",
        f"bc.data.train_path={experts}", "bc.tokens_per_batch=2048", *(f"bc.{o}" for o in trainer),
        "rollout.tasks=buffer_experts", "rollout.agent.max_turns=3", "rollout.agent.max_new_tokens=8",
        "eval.splits=[seen]", "eval.limit=1", "eval.agent.max_turns=2", "eval.agent.max_new_tokens=8",
        f"buffer.expert_path={experts}", "buffer.num_expert=2",
        # one trajectory per critic step: 4 steps per epoch
        "critic.epochs=2", "critic.batch_tokens=64", "critic.checkpoint_every_steps=2", "critic.feature_cache=false",
        "critic.head_hidden=16", "critic.device=cpu", "critic.retrospective.enabled=false",
        # the steps counted are the critic's own (k-fold refits after training would add theirs; their
        # resume is tested in tests/test_critic_diagnostics.py)
        "critic.diagnostics.folds=0",
        "policy.tokens_per_batch=2048", *(f"policy.{o}" for o in trainer),
        "baselines=[rft, eto]", "rft.tokens_per_batch=2048", *(f"rft.{o}" for o in trainer),
        "eto.tokens_per_batch=4096", *(f"eto.{o}" for o in trainer),
    ]


def stage_of(output_dir: Path, root: Path) -> str:
    """The stage whose work folder (``<parent>/.<leaf>.partial``) ``output_dir`` is."""
    relative = Path(output_dir).resolve().relative_to(root.resolve())
    assert relative.name.startswith(".") and relative.name.endswith(".partial"), relative
    return str(relative.parent / relative.name[1:-len(".partial")]).removeprefix("./")


class Interrupter:
    """Raises KeyboardInterrupt in the armed stage before its optimizer step ``at`` (0-based; the critic's:
    the ``at``-th call of its loss, 1-based), and counts the steps each stage runs in this invocation."""

    def __init__(self, monkeypatch):
        import qevolve.critic.iql as critic_iql
        from qevolve.training.trainer import Trainer

        self.root: Path | None = None
        self.armed: tuple[str, int] | None = None
        self.steps: dict[str, int] = {}
        real_finish, real_losses = Trainer.finish_step, critic_iql.iql_losses
        interrupter = self

        def finish_step(trainer, stage, step, *args, **kwargs):
            name = stage_of(trainer.output_dir, interrupter.root)
            if interrupter.armed == (name, step):
                raise KeyboardInterrupt(f"interrupted before step {step + 1} of {name}")
            interrupter.steps[name] = interrupter.steps.get(name, 0) + 1
            return real_finish(trainer, stage, step, *args, **kwargs)

        def iql_losses(*args, **kwargs):
            calls = interrupter.steps.get("iter_1/critic", 0) + 1
            if interrupter.armed == ("iter_1/critic", calls):
                raise KeyboardInterrupt(f"interrupted in step {calls} of the critic")
            interrupter.steps["iter_1/critic"] = calls
            return real_losses(*args, **kwargs)

        monkeypatch.setattr(Trainer, "finish_step", finish_step)
        monkeypatch.setattr(critic_iql, "iql_losses", iql_losses)  # as the critic's IQLLearner calls it

    def start(self, root: Path, armed: tuple[str, int] | None = None) -> None:
        self.root, self.armed, self.steps = root, armed, {}


def test_each_interrupted_training_stage_resumes_from_its_checkpoint_to_the_same_weights(overrides, tmp_path,
                                                                                         monkeypatch):
    interrupter = Interrupter(monkeypatch)
    reference = load_config(EvolveConfig, None, [*overrides, f"runs_dir={tmp_path / 'reference'}", "name=run"])
    ref_root = tmp_path / "reference" / "run"
    interrupter.start(ref_root)
    run_evolve(reference, log=lambda m: None)
    total = dict(interrupter.steps)
    assert total == {**dict.fromkeys(POLICY_STAGES, STEPS), "iter_1/critic": 8}  # 2 epochs of 4 trajectories

    config = load_config(EvolveConfig, None, [*overrides, f"runs_dir={tmp_path / 'interrupted'}", "name=run"])
    # resumed with other worker counts and logging: settings that change no result
    changed = load_config(EvolveConfig, None, [*overrides, f"runs_dir={tmp_path / 'interrupted'}", "name=run",
                                               "rollout.agent.num_workers=1", "eval.agent.num_workers=1",
                                               "tensorboard=true"])
    root = tmp_path / "interrupted" / "run"
    rng = random.Random(7)
    resumed_from: dict[str, int] = {}
    messages: list[str] = []

    def continued_from_its_checkpoint(stage: str) -> None:
        """The stage interrupted last time ran only the steps after its checkpoint in this invocation."""
        assert interrupter.steps[stage] == total[stage] - resumed_from[stage], stage
        step = resumed_from[stage]
        said = "resuming at epoch" if stage == "iter_1/critic" else "resumed from"
        assert any(said in m and f"step {step}" in m for m in messages), (stage, messages)

    previous = None
    for stage in TRAINING_STAGES:
        # interrupted after at least one checkpoint, between two of them or right after one
        at = rng.randint(3, total[stage]) if stage == "iter_1/critic" else rng.randint(SAVE_EVERY + 1, STEPS - 1)
        interrupter.start(root, (stage, at))
        messages.clear()
        with pytest.raises(KeyboardInterrupt) as caught:
            run_evolve(config if previous is None else changed, resume=previous is not None, log=messages.append)
        if previous is not None:
            continued_from_its_checkpoint(previous)
        done = at - 1 if stage == "iter_1/critic" else at  # steps completed before the interruption
        assert interrupter.steps.get(stage, 0) == done
        resumed_from[stage] = done - done % SAVE_EVERY  # the critic checkpoints every 2 steps too
        assert resumed_from[stage] > 0
        assert (caught.value.stage, caught.value.resume_step) == (stage, resumed_from[stage])
        parent, _, leaf = stage.rpartition("/")
        assert (root / parent / f".{leaf}.partial").is_dir()  # the unfinished stage's work is kept
        previous = stage
    interrupter.start(root)
    messages.clear()
    run_evolve(changed, resume=True, log=messages.append)
    continued_from_its_checkpoint(previous)
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["resume_changes"] == [{"after_stage": None, "changes": {  # BC, the first stage, was unfinished
        "tensorboard": [False, True], "rollout.agent.num_workers": [2, 1], "eval.agent.num_workers": [2, 1]}}]

    ours = json.loads((root / "manifest.json").read_text())["stages"]
    theirs = json.loads((ref_root / "manifest.json").read_text())["stages"]
    assert [s["name"] for s in ours] == [s["name"] for s in theirs]
    for mine, reference_stage in zip(ours, theirs):
        # inputs, outputs, metrics and the digests of every weight, checkpoint and trajectory
        assert mine == reference_stage, mine["name"]
    assert all(s["digests"] for s in ours if s["name"] in TRAINING_STAGES)
    for stage in POLICY_STAGES:  # the final weights, byte for byte
        final = sorted((ref_root / stage / "final").glob("*.safetensors"))
        assert final and all((root / stage / "final" / f.name).read_bytes() == f.read_bytes() for f in final), stage
    assert not list(root.glob("**/.*.partial"))


def wait_for(predicate, proc: subprocess.Popen, what: str) -> None:
    """Until ``predicate()`` holds (polling; fails when the process ends first)."""
    import time

    while not predicate():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}"
        time.sleep(0.05)


def test_sigint_and_sigterm_name_the_stage_and_the_resume_command_and_keep_the_checkpoints(overrides, tmp_path):
    # a behaviour cloning long enough to be inside it whenever the signal comes
    args = [a for a in overrides if not a.startswith("bc.max_steps=") and not a.startswith("bc.save_every=")]
    args += ["bc.max_steps=100000", "bc.save_every=1", f"runs_dir={tmp_path}", "name=run"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    work = tmp_path / "run" / ".bc.partial"

    def run(*extra: str) -> tuple[subprocess.Popen, Path, Path]:
        out, err = tmp_path / f"out{len(extra)}.txt", tmp_path / f"err{len(extra)}.txt"
        proc = subprocess.Popen([sys.executable, "-m", "qevolve.cli", "evolve", *args, *extra], env=env,
                                stdout=open(out, "w"), stderr=open(err, "w"))
        return proc, out, err

    def checkpoints() -> list[int]:
        return sorted(int(p.parent.name.split("-")[1]) for p in work.glob("checkpoints/step-*/trainer_state.pt"))

    proc, _, err = run()
    wait_for(lambda: checkpoints(), proc, "the first checkpoint")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 130
    assert len(err.read_text().strip().splitlines()) == 1  # one line, no traceback
    last = err.read_text().strip()
    kept = checkpoints()[-1]
    assert last.startswith(f"interrupted in stage bc (its checkpoint at step {kept} is kept) by SIGINT; "
                           "continue with: qevolve evolve "), last
    assert last.endswith(" bc.max_steps=100000 bc.save_every=1 " + f"runs_dir={tmp_path} name=run --resume")

    proc, out, err = run("--resume")
    wait_for(lambda: f"bc: resumed from {work / 'checkpoints' / f'step-{kept:06d}'} at step {kept}" in out.read_text(),
             proc, "the resumed behaviour cloning")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 143
    last = err.read_text().strip().splitlines()[-1]
    assert last.startswith("interrupted in stage bc (its checkpoint at step ") and " by SIGTERM; continue with: " in last
    assert last.endswith("name=run --resume") and last.count("--resume") == 1
    assert checkpoints()[-1] >= kept


def test_the_resume_command_keeps_the_arguments_and_drops_redo(monkeypatch):
    from qevolve.cli import resume_command

    monkeypatch.setattr(sys, "argv", ["qevolve", "evolve", "--config", "my runs/c.yaml", "--redo", "iter_1/critic",
                                      "seed=2"])
    assert resume_command() == "qevolve evolve --config 'my runs/c.yaml' seed=2 --resume"
    monkeypatch.setattr(sys, "argv", ["qevolve", "evolve", "-c", "c.yaml", "--resume", "--redo=bc"])
    assert resume_command() == "qevolve evolve -c c.yaml --resume"
