"""A stand-alone `qevolve eval` of a run's saved policy repeats the run's evaluation: same trajectories
(content digest) and success rate; the run's manifest holds no field the loop decides itself."""

import json

import pytest
from typer.testing import CliRunner

from qevolve.buffer.store import store_digest, write_episodes
from qevolve.config import load_config
from qevolve.evolve.loop import DERIVED_FIELDS, EvolveConfig, run_evolve

pytestmark = pytest.mark.usefixtures("alfworld_installed")


@pytest.fixture(scope="module")
def experts_path(alfworld_experts, tmp_path_factory):
    path = tmp_path_factory.mktemp("experts") / "experts.parquet"
    write_episodes(path, alfworld_experts)
    return path


SENTINEL_SEED = 424242
SENTINEL_MODEL = {"name_or_path": "sentinel-model", "lora": {"r": 3}}
SENTINEL_PROMPT = {"max_prompt_tokens": 999}
# a value in every field of DERIVED_FIELDS of the sections this run builds (bypassing the load-time check):
# none may reach a stage
SENTINELS = {
    "bc": {"model": SENTINEL_MODEL, "prompt": SENTINEL_PROMPT, "output_dir": "sentinel", "seed": SENTINEL_SEED,
           "progress": True, "resume": False, "data": {"env": "webshop", "task_types": ["sentinel"]}},
    "policy": {"env": "webshop", "buffer_path": "sentinel", "model": SENTINEL_MODEL, "reference": "sentinel",
               "prompt": SENTINEL_PROMPT, "output_dir": "sentinel", "seed": SENTINEL_SEED, "progress": True,
               "resume": False},
    "critic": {"seed": SENTINEL_SEED},
    "rollout": {"agent": {"seed": SENTINEL_SEED}},
    "eval": {"agent": {"seed": SENTINEL_SEED}},
}


def _overwritten(section, given, used) -> set[str]:
    """The DERIVED_FIELDS entries whose fields differ between a section as configured and as a stage used it;
    fails on a differing field that is not derived (the loop overwrote a field the list does not name)."""
    from qevolve.config import find_derived
    from qevolve.evolve.digests import differing_fields

    out = set()
    for name in differing_fields(given, used, section):
        found = find_derived(EvolveConfig, name)
        assert found is not None, f"the loop changes {name}, which DERIVED_FIELDS does not list"
        out.add(found[0])
    return out


def test_eval_of_a_saved_policy_repeats_the_runs_evaluation(experts_path, tiny_model_dir, tmp_path, monkeypatch):
    import qevolve.critic.train
    import qevolve.policy.bc
    import qevolve.policy.bppo
    import qevolve.rollouts.run
    from qevolve.cli import app
    from qevolve.config import merge_trees

    config = load_config(EvolveConfig, None, [
        "name=tiny", f"runs_dir={tmp_path / 'runs'}", "iterations=1", "progress=false", "num_threads=1",
        f"model.name_or_path={tiny_model_dir}", "model.precision=fp32", "model.device=cpu",
        "model.lora.enabled=false", "prompt.max_prompt_tokens=1024", "prompt.reserve_action_tokens=16",
        f"bc.data.train_path={experts_path}", "bc.max_steps=1", "bc.grad_accum_steps=1", "bc.tokens_per_batch=2048",
        "bc.tensorboard=false", "bc.data.seed=5",  # null: the loop draws it from the seed tree
        "rollout.limit=2", "rollout.task_stride=500", "rollout.agent.max_turns=2",
        "rollout.agent.max_new_tokens=8", "eval.splits=[seen, unseen]", "eval.limit=2", "eval.task_stride=7",
        "eval.agent.max_turns=3", "eval.agent.max_new_tokens=6", "eval.agent.temperature=1.0",
        f"critic.init={tiny_model_dir}",  # null: critic_init decides it
        "critic.epochs=1", "critic.feature_cache=false", "critic.head_hidden=16", "critic.device=cpu",
        "policy.max_steps=1", "policy.grad_accum_steps=1", "policy.tokens_per_batch=2048",
        "policy.tensorboard=false"])
    config = EvolveConfig.model_validate(merge_trees(config.model_dump(mode="json"), SENTINELS))
    used: dict[str, list] = {}

    def capture(module, name, key):
        real = getattr(module, name)

        def wrapper(stage_config, *args, **kwargs):
            used.setdefault(key(stage_config) if callable(key) else key, []).append(stage_config)
            return real(stage_config, *args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    capture(qevolve.policy.bc, "run_bc", "bc")
    capture(qevolve.policy.bppo, "run_policy_update", "policy")
    capture(qevolve.rollouts.run, "run_rollouts", lambda rc: "rollout" if rc.source == "self" else "eval")
    real_train_critic = qevolve.critic.train.train_critic
    monkeypatch.setattr(qevolve.critic.train, "train_critic", lambda episodes, cfg, *a, **k: (
        used.setdefault("critic", []).append(cfg), real_train_critic(episodes, cfg, *a, **k))[1])
    run_evolve(config, log=lambda m: None)

    # every field the loop decides was decided by it, and it changed no other
    for section in ("bc", "policy", "critic"):
        given = getattr(config, section).model_dump(mode="json")
        assert _overwritten(section, given, used[section][0].model_dump(mode="json")) == \
            {name for name in DERIVED_FIELDS if name.startswith(f"{section}.")}, section
    for section in ("rollout", "eval"):
        given = getattr(config, section).agent.model_dump(mode="json")
        for rc in used[section]:
            assert _overwritten(f"{section}.agent", given, rc.agent.model_dump(mode="json")) == {f"{section}.agent.seed"}

    root = tmp_path / "runs" / "tiny"
    manifest = json.loads((root / "manifest.json").read_text())
    recorded = manifest["config"]
    assert "model" not in recorded["bc"] and "model" not in recorded["policy"]  # no bc.model.lora.enabled: true
    assert recorded["model"]["lora"]["enabled"] is False and "seed" not in recorded["critic"]
    stages = {stage["name"]: stage for stage in manifest["stages"]}

    # sampled decoding (temperature 1): the same trajectories need each split's seed from the run, too
    monkeypatch.chdir(tmp_path)
    for prefix, policy in (("iter_1", root / "iter_1/policy/final"), ("bc", root / "bc/final")):
        output = tmp_path / "again" / prefix
        result = CliRunner().invoke(app, ["eval", "--checkpoint", str(policy), "--output", str(output)])
        assert result.exit_code == 0, result.output
        for split in ("seen", "unseen"):
            stage = stages[f"{prefix}/eval_{split}"]
            again = json.loads((output / f"eval_{split}" / "metrics.json").read_text())
            assert again["success_rate"] == stage["metrics"]["success_rate"]
            assert again["episodes"] == stage["metrics"]["episodes"] == 2
            assert store_digest(output / f"eval_{split}" / "trajectories") == \
                store_digest(root / stage["outputs"]["trajectories"]), (prefix, split)
    # an explicit choice still wins: one split, the others as recorded
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(root / "iter_1/policy/final"), "--split", "seen",
                                      "--output", str(tmp_path / "one"), "agent.max_new_tokens=7"])
    assert result.exit_code == 0, result.output
    again = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert again["protocol"]["split"] == "seen" and again["protocol"]["limit"] == 2


def test_rft_config_decides_exactly_the_rft_fields_listed():
    from pathlib import Path

    from qevolve.config import merge_trees
    from qevolve.evolve.loop import rft_config

    sentinels = {"model": SENTINEL_MODEL, "prompt": SENTINEL_PROMPT, "output_dir": "sentinel", "seed": SENTINEL_SEED,
                 "progress": False, "resume": False, "data": {"env": "webshop", "train_path": "sentinel",
                                                            "only_won": False, "task_types": ["x"],
                                                            "num_demonstrations": 3}}
    config = EvolveConfig.model_validate(merge_trees(EvolveConfig().model_dump(mode="json"), {"rft": sentinels}))
    rft = rft_config(config, "start", Path("buffer.parquet"), Path("out"), 7)
    assert _overwritten("rft", config.rft.model_dump(mode="json"), rft.model_dump(mode="json")) == \
        {name for name in DERIVED_FIELDS if name.startswith("rft.")}
