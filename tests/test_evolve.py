"""The whole loop end to end on real ALFWorld games with a tiny policy (K = 2), and its resume."""

import json
import sys

import pytest

from qevolve.buffer.store import read_episodes, write_episodes
from qevolve.config import ConfigError, load_config
from qevolve.evolve.loop import EvolveConfig, run_evolve

pytestmark = pytest.mark.usefixtures("alfworld_installed")


def tiny_config(tmp_path, experts_path, model_dir, name="tiny"):
    overrides = [
        f"name={name}", f"runs_dir={tmp_path / 'runs'}", "iterations=2", "progress=false", "num_threads=1",
        f"model.name_or_path={model_dir}", "model.precision=fp32", "model.device=cpu",
        "prompt.max_prompt_tokens=1024", "prompt.reserve_action_tokens=16",
        f"bc.data.train_path={experts_path}", "bc.max_steps=2", "bc.grad_accum_steps=1", "bc.tokens_per_batch=2048",
        "bc.tensorboard=false",
        "rollout.limit=2", "rollout.task_stride=500", "rollout.agent.max_turns=2", "rollout.agent.max_new_tokens=8",
        "eval.limit=1", "eval.agent.max_turns=2", "eval.agent.max_new_tokens=8",
        f"buffer.expert_path={experts_path}",
        "critic.epochs=2", "critic.feature_cache=false", "critic.head_hidden=16", "critic.device=cpu",
        "policy.max_steps=1", "policy.grad_accum_steps=1", "policy.tokens_per_batch=2048", "policy.tensorboard=false",
    ]
    return load_config(EvolveConfig, None, overrides)


@pytest.fixture(scope="module")
def experts_path(alfworld_experts, tmp_path_factory):
    path = tmp_path_factory.mktemp("experts") / "experts.parquet"
    write_episodes(path, alfworld_experts)
    return path


def test_two_iterations_end_to_end_and_resume_after_a_kill_in_the_critic(experts_path, tiny_model_dir, tmp_path,
                                                                         monkeypatch):
    import qevolve.evolve.loop as loop

    released = []
    real_release = loop.release_free_memory
    monkeypatch.setattr(loop, "release_free_memory", lambda: released.append(1) or real_release())
    config = tiny_config(tmp_path / "a", experts_path, tiny_model_dir)
    messages: list[str] = []
    table = run_evolve(config, log=messages.append)
    root = tmp_path / "a" / "runs" / "tiny"
    manifest = json.loads((root / "manifest.json").read_text())
    names = [s["name"] for s in manifest["stages"]]
    assert names == ["bc", "bc/probe", "bc/eval_seen", "bc/eval_unseen"] + [
        f"iter_{k}/{stage}" for k in (1, 2) for stage in
        ("rollouts", "buffer", "critic", "label", "policy", "probe", "eval_seen", "eval_unseen")]
    assert [row["policy"] for row in table] == ["BC", "Q-Evolve iter 1", "Q-Evolve iter 2"]
    # the format probe of every policy, on the same states (BC's demonstrations: the tiny expert set is all used)
    probes = {s["name"]: s for s in manifest["stages"] if s["name"].endswith("/probe")}
    for probe in probes.values():
        # fewer turns than probe.states (32): every turn of the demonstrations
        assert probe["metrics"]["states"] == min(32, sum(ep.num_turns for ep in read_episodes(experts_path)))
        assert probe["metrics"]["held_out_states"] == 0
        assert {"format_error_rate", "truncated_turn_rate", "length_p50", "length_p90", "length_max"} <= set(probe["metrics"])
        assert probe["metrics"]["max_new_tokens"] == 8  # eval.agent's
    rows = [[(r["episode_id"], r["turn_index"]) for r in map(json.loads, (root / n / "probe.jsonl").read_text().splitlines())]
            for n in probes]
    assert all(r == rows[0] for r in rows) and len(rows[0]) == probes["bc/probe"]["metrics"]["states"]
    assert probes["iter_1/probe"]["inputs"]["policy"] == "iter_1/policy/final"
    critic_metrics = next(s["metrics"] for s in manifest["stages"] if s["name"] == "iter_1/critic")
    assert critic_metrics["converged"] in (0, 1) and "v_mean" in critic_metrics  # the convergence check is recorded
    # 2 epochs: too few for the held-out curve's two windows, so the drift criterion decided
    assert critic_metrics["converged_by"] == "drift"
    # the fit after training, in-sample and 4-fold held out (the default), recorded and logged
    assert (critic_metrics["kfold_folds"], critic_metrics["kfold_epochs"]) == (4, 2)
    assert {"insample_explained_variance", "insample_auc_won_vs_lost", "kfold_explained_variance",
            "kfold_auc_won_vs_lost"} <= set(critic_metrics)
    assert (root / "iter_1/critic/kfold.json").is_file()
    line = next(m for m in messages if m.startswith("[iter_1/critic] explained variance: in-sample "))
    assert ", 4-fold held-out " in line and "AUC V(s_0) won vs lost" in line and " by the last epoch's change" in line
    labelled = read_episodes(root / "iter_2/label/labelled.parquet")
    assert {ep.source for ep in labelled} == {"expert", "self"}
    assert all(t.advantage is not None and t.value is not None and t.r_aux is not None
               for ep in labelled for t in ep.turns)
    assert (root / "iter_2/policy/final/adapter_config.json").is_file()
    assert len((root / "metrics.jsonl").read_text().splitlines()) == len(names)
    assert len(released) == len(names)  # freed heap memory handed back after every stage

    # Same run, killed inside iteration 1's critic stage, then resumed.
    import qevolve.critic.train as critic_train

    real = critic_train.train_critic

    def killed(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt("killed during the critic stage")

    monkeypatch.setattr(critic_train, "train_critic", killed)
    config_b = tiny_config(tmp_path / "b", experts_path, tiny_model_dir)
    with pytest.raises(KeyboardInterrupt):
        run_evolve(config_b, log=lambda m: None)
    root_b = tmp_path / "b" / "runs" / "tiny"
    done = [s["name"] for s in json.loads((root_b / "manifest.json").read_text())["stages"]]
    assert done[-1] == "iter_1/buffer" and not (root_b / "iter_1/critic").exists()
    monkeypatch.setattr(critic_train, "train_critic", real)
    with pytest.raises(Exception, match="pass --resume"):
        run_evolve(config_b, log=lambda m: None)
    run_evolve(config_b, resume=True, log=lambda m: None)
    manifest_b = json.loads((root_b / "manifest.json").read_text())
    for key in ("stages", "seed", "versions"):
        assert manifest_b[key] == manifest[key], key
    assert {k: v for k, v in manifest_b["config"].items() if k != "runs_dir"} == \
           {k: v for k, v in manifest["config"].items() if k != "runs_dir"}


def test_bad_config_fails_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="unknown field 'critic.epoch'"):
        load_config(EvolveConfig, None, ["critic.epoch=3"])
    with pytest.raises(ConfigError, match="field 'iterations'"):
        load_config(EvolveConfig, None, ["iterations=two"])
    assert not (tmp_path / "runs").exists()


def test_every_shipped_evolve_config_loads():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    files = [root / "alfworld-quickstart.yaml", root / "alfworld.yaml", *sorted((root / "ablations").glob("*.yaml"))]
    assert len(files) == 13
    configs = {f.stem: load_config(EvolveConfig, f) for f in files}
    grpo = configs.pop("grpo")  # the GRPO baseline beside the full run: only its baselines and grpo section differ
    assert grpo.baselines == ["grpo"] and grpo.grpo.env_steps == 13000 and grpo.grpo.rounds is None
    assert grpo.grpo.policy.standardize_advantages == "none" and grpo.grpo.policy.objective.eps_low == 0.2
    ppo = configs.pop("ppo")  # the PPO baseline beside the full run: only its baselines and ppo section differ
    assert ppo.baselines == ["ppo"] and ppo.ppo.env_steps == 13000 and ppo.ppo.rounds is None
    assert ppo.ppo.policy.standardize_advantages == "buffer" and ppo.ppo.policy.objective.eps_high == 0.2
    assert (ppo.ppo.gamma, ppo.ppo.gae_lambda) == (0.99, 0.95)

    def without(config, *fields):
        return {k: v for k, v in config.model_dump().items()
                if k not in ("name", "baselines", "grpo", "ppo", *fields)}

    assert without(grpo, "critic") == without(configs["plain_iql"], "critic") and grpo.critic == configs["awr"].critic
    assert without(ppo) == without(grpo)
    assert configs["plain_iql"].critic.iql.weighting.scheme == "plain"
    assert configs["awr"].policy.objective.name == "awr"
    assert configs["awr"].policy.objective.kl_coef == 0.0  # the paper's AWR has no KL term
    assert configs["alfworld"].policy.objective.kl_coef > 0  # BPPO keeps it
    assert {c.policy.standardize_advantages for c in configs.values()} == {"buffer"}
    assert configs["no_rr"].critic.retrospective.enabled is False
    assert {configs[f"adv_{e}"].label.estimator for e in ("gae_env", "gae_env_aux", "td1", "q_minus_v")} == \
           {"gae_env", "gae_env_aux", "td1", "q_minus_v"}


def test_cpu_protocol_configs_load_with_every_row():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs" / "cpu"
    configs = {f.stem: load_config(EvolveConfig, f) for f in sorted(root.glob("*.yaml"))}
    assert set(configs) == {"alfworld", "webshop", "webshop-v2", "webshop-quick", "webshop-quick-ablations",
                            "webshop-quick-variants", "webshop-faithful", "webshop-sample-efficiency"}
    for name in ("webshop-quick", "webshop-quick-ablations", "webshop-quick-variants", "webshop-faithful",
                 "webshop-sample-efficiency"):
        configs.pop(name)  # the quickstart candidate, the seed study and the sample-efficiency figure: own tests
    v1, v2 = configs["webshop"].model_dump(), configs["webshop-v2"].model_dump()
    v2["critic"]["epochs"], v2["critic"]["iql"]["polyak"] = v1["critic"]["epochs"], v1["critic"]["iql"]["polyak"]
    assert (v2.pop("name"), v1.pop("name")) == ("cpu-webshop-v2", "cpu-webshop") and v1 == v2  # only the critic
    for config in configs.values():
        assert config.baselines == ["rft", "eto", "rerank"] and config.iterations == 2
        assert set(config.variants) == {"plain_iql", "q_minus_v", "awr"}
        assert config.variants["awr"].policy["objective"]["kl_coef"] == 0.0
        assert config.rollout.tasks == "buffer_experts" and config.eto.beta == 0.1
    assert configs["alfworld"].task_types and configs["alfworld"].model.lora.enabled is False


def test_the_seed_study_configs_are_what_their_headers_promise():
    """The faithful protocol keeps the method's data flow at every size its header calls a minimum, and
    the quick protocol's diagnosis changes nothing but the pre-registered variants."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs" / "cpu"
    faithful = load_config(EvolveConfig, root / "webshop-faithful.yaml")
    assert faithful.seeds == [0, 1, 2] and faithful.iterations == 3 and faithful.eval.limit >= 100
    assert faithful.buffer.expert_source == "bc" and faithful.buffer.num_expert is None
    assert faithful.rollout.tasks == "buffer_experts" and faithful.rollout.episodes_per_task >= 2
    assert faithful.rollout.agent.temperature > 0 and faithful.eval.agent.temperature == 0
    demonstrations = faithful.bc.data.num_demonstrations
    assert demonstrations * (1 + faithful.rollout.episodes_per_task) >= 200  # the buffer's trajectories
    assert faithful.baselines == ["rft", "eto"] and faithful.eto.beta == 0.1
    quick = load_config(EvolveConfig, root / "webshop-quick.yaml").model_dump()
    variants = load_config(EvolveConfig, root / "webshop-quick-variants.yaml").model_dump()
    assert set(variants.pop("variants")) == {
        "positive_only", "eps_low_02", "eps_low_05", "standardize_none", "standardize_buffer_scale", "outcome_only",
        "gae_env_aux", "no_penalties", "expert_turns_only", "self_turns_only"}
    quick.pop("variants")
    assert variants == quick


def test_webshop_quickstart_candidate_is_v2_shrunk_only_where_its_header_says():
    """configs/cpu/webshop-quick.yaml was fixed as v2 with smaller data and budgets; nothing else may differ."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs" / "cpu"
    v2 = load_config(EvolveConfig, root / "webshop-v2.yaml").model_dump()
    quick = load_config(EvolveConfig, root / "webshop-quick.yaml").model_dump()
    changed = {("name",): "cpu-webshop-quick", ("iterations",): 1, ("bc", "data", "num_demonstrations"): 32,
               ("bc", "grad_accum_steps"): 1, ("bc", "save_every"): 5, ("eval", "limit"): 50,
               ("eval", "agent", "batch_size"): 25, ("buffer", "num_expert"): 16, ("critic", "epochs"): 500,
               ("policy", "grad_accum_steps"): 1, ("rft", "grad_accum_steps"): 1, ("baselines",): ["rft"],
               # checkpoints every few minutes of the shorter steps (they change no result)
               ("policy", "save_every"): 3, ("rft", "save_every"): 5,
               ("variants",): {}}
    for path, value in changed.items():
        q, v = quick, v2
        for key in path[:-1]:
            q, v = q[key], v[key]
        assert q[path[-1]] == value, path
        q[path[-1]] = v[path[-1]]
    for unused in ("eto", "rerank"):  # baselines the candidate does not run
        quick.pop(unused), v2.pop(unused)
    assert quick == v2


def test_webshop_quick_ablations_extend_the_quick_run_with_v2s_rows():
    """configs/cpu/webshop-quick-ablations.yaml adds only stages to the quick run (so --resume extends it),
    and those stages are v2's (ETO at 1 step per micro-batch, as the quick protocol runs BPPO and RFT)."""
    from pathlib import Path

    from qevolve.evolve.loop import extension_of
    from qevolve.evolve.run_dir import first_difference

    root = Path(__file__).resolve().parents[1] / "configs" / "cpu"
    quick = load_config(EvolveConfig, root / "webshop-quick.yaml").model_dump(mode="json")
    wider = load_config(EvolveConfig, root / "webshop-quick-ablations.yaml").model_dump(mode="json")
    v2 = load_config(EvolveConfig, root / "webshop-v2.yaml").model_dump(mode="json")
    extended, changes = extension_of(quick, wider)
    assert first_difference(extended, wider) is None and wider["name"] == quick["name"]
    assert changes == ["iterations 1 -> 2", "baselines + eto, rerank", "variants + q_minus_v, awr, plain_iql"]
    assert wider["variants"] == v2["variants"] and wider["rerank"] == v2["rerank"]
    assert wider["baselines"] == v2["baselines"] and wider["iterations"] == v2["iterations"]
    assert wider["eto"] == {**v2["eto"], "grad_accum_steps": 1, "save_every": 3}


def test_baselines_and_variants_from_the_same_buffer(experts_path, tiny_model_dir, tmp_path):
    """One command gives RFT, ETO-DPO and an ablation variant beside Q-Evolve, all from iteration 1's buffer."""
    config = tiny_config(tmp_path, experts_path, tiny_model_dir, name="baselines")
    config = config.model_copy(update={
        "iterations": 1, "baselines": ["rft", "eto", "rerank"],
        "rollout": config.rollout.model_copy(update={"tasks": "buffer_experts"}),
        "buffer": config.buffer.model_copy(update={"num_expert": 2}),
        "eval": config.eval.model_copy(update={"splits": ["seen"]}),
        "rft": config.rft.model_copy(update={"max_steps": 1, "grad_accum_steps": 1, "tokens_per_batch": 2048,
                                             "tensorboard": False}),
        "eto": config.eto.model_copy(update={"max_steps": 1, "grad_accum_steps": 1, "tokens_per_batch": 4096,
                                             "tensorboard": False}),
    })
    config = EvolveConfig.model_validate({**config.model_dump(), "variants": {
        "q_minus_v": {"label": {"estimator": "q_minus_v"}},
        "awr": {"policy": {"objective": {"name": "awr", "kl_coef": 0.0}}},
    }})
    table = run_evolve(config, log=lambda m: None)
    root = tmp_path / "runs" / "baselines"
    names = [s["name"] for s in json.loads((root / "manifest.json").read_text())["stages"]]
    assert names == ["bc", "bc/probe", "bc/eval_seen", "iter_1/rollouts", "iter_1/buffer", "iter_1/critic",
                     "iter_1/label", "iter_1/policy", "iter_1/probe", "iter_1/eval_seen", "iter_1/rft/policy",
                     "iter_1/rft/probe", "iter_1/rft/eval_seen", "iter_1/eto/policy", "iter_1/eto/probe",
                     "iter_1/eto/eval_seen", "iter_1/rerank/eval_seen", "iter_1/q_minus_v/label",
                     "iter_1/q_minus_v/policy", "iter_1/q_minus_v/probe", "iter_1/q_minus_v/eval_seen",
                     "iter_1/awr/policy", "iter_1/awr/probe", "iter_1/awr/eval_seen"]
    assert [row["policy"] for row in table] == ["BC", "Q-Evolve iter 1", "RFT (iter 1 buffer)",
                                                "ETO-DPO (iter 1 buffer)", "critic re-rank (iter 1 critic)",
                                                "q_minus_v (iter 1)", "awr (iter 1)"]
    # every baseline and variant starts from the iteration's starting policy (here the BC policy)
    stages = {s["name"]: s for s in json.loads((root / "manifest.json").read_text())["stages"]}
    assert {stages[n]["inputs"]["start"] for n in ("iter_1/rft/policy", "iter_1/eto/policy",
                                                   "iter_1/awr/policy")} == {"bc/final"}
    # the self rollouts ran on exactly the buffer's expert tasks, so every failure has a partner
    buffer = read_episodes(root / "iter_1/buffer/buffer.parquet")
    expert_tasks = {ep.task_id for ep in buffer if ep.source == "expert"}
    assert {ep.task_id for ep in buffer if ep.source == "self"} == expert_tasks and len(expert_tasks) == 2
    rerank = stages["iter_1/rerank/eval_seen"]
    assert rerank["inputs"] == {"policy": "bc/final", "critic": "iter_1/critic"}
    protocol = json.loads((root / "iter_1/rerank/eval_seen/metrics.json").read_text())["protocol"]
    assert protocol["rerank"]["candidates"] == 4 and protocol["decoding"].startswith("T=1.0")
    # the comparison reads every row's episodes from the real run directory
    from qevolve.evaluation.compare import compare_runs

    rows = {row["method"]: row for row in compare_runs([root], resamples=200)["rows"]}
    assert len(rows) == len(table) and all(row["episodes"] == 1 for row in rows.values())
    assert all("success_diff_ci" in row for method, row in rows.items() if method != "SFT (BC)")
    # a real run's outcomes file compares like its run directory
    from qevolve.atomic_io import write_json_atomic
    from qevolve.evaluation.compare import export_outcomes

    exported = write_json_atomic(tmp_path / "baselines.json", export_outcomes(root))
    assert compare_runs([exported], resamples=200)["rows"] == compare_runs([root], resamples=200)["rows"]
    labelled = read_episodes(root / "iter_1/q_minus_v/label/labelled.parquet")
    main = read_episodes(root / "iter_1/label/labelled.parquet")
    assert [t.advantage for ep in labelled for t in ep.turns] != [t.advantage for ep in main for t in ep.turns]
    # every training stage's per-step curves reach the report and the run's TensorBoard folder
    from qevolve.evaluation.report import build_report, collect_series
    from qevolve.scalars import read_event_scalars

    page = build_report(root, resamples=200).read_text()
    for name in ("bc", "iter_1/critic", "iter_1/policy", "iter_1/rft/policy", "iter_1/eto/policy", "iter_1/awr/policy"):
        assert f"<h3 id='training-{name}'>" in page, name
    assert [k for k, _ in collect_series(list(stages.values()))["success_rate"]["seen"]] == [0, 1]
    assert {"iter_1/policy/policy/kl_ref", "bc/train/loss", "iter_1/critic/critic/loss_v"} <= \
        set(read_event_scalars(root / "tensorboard"))


def test_the_format_probe_warns_when_the_update_raised_format_errors_and_is_skipped_on_resume(
        experts_path, tiny_model_dir, tmp_path):
    """A negative probe.max_format_error_increase makes any policy update cross it: the warning names the stage."""
    config = tiny_config(tmp_path, experts_path, tiny_model_dir, name="probe")
    config = config.model_copy(update={
        "iterations": 1, "eval": config.eval.model_copy(update={"splits": ["seen"]}),
        "probe": config.probe.model_copy(update={"states": 4, "max_format_error_increase": -1.0})})
    lines: list[str] = []
    run_evolve(config, log=lines.append)
    root = tmp_path / "runs" / "probe"
    stages = {s["name"]: s for s in json.loads((root / "manifest.json").read_text())["stages"]}
    bc, it = stages["bc/probe"]["metrics"], stages["iter_1/probe"]["metrics"]
    assert bc["states"] == it["states"] == 4
    assert f"[bc/probe] format errors {bc['format_error_rate']:.0%} on 4 states" in "\n".join(lines)
    line = next(m for m in lines if m.startswith("[iter_1/probe] format errors"))
    assert f"(BC {bc['format_error_rate']:.0%}) on 4 states" in line and "max_new_tokens=8" in line
    assert any(m.startswith("[iter_1/probe] WARNING: the format-error rate rose") and "probe.jsonl" in m
               for m in lines)
    assert not any(m.startswith("[bc/probe] WARNING") for m in lines)
    # resumed (nothing left to do): the probes are skipped, their lines and the warning are logged again
    again: list[str] = []
    run_evolve(config, resume=True, log=again.append)
    assert "[bc/probe] done earlier, skipped (resume)" in again and "[iter_1/probe] done earlier, skipped (resume)" in again
    assert not any(m.endswith("] running") for m in again)
    assert any(m.startswith("[iter_1/probe] WARNING") for m in again)
    assert json.loads((root / "manifest.json").read_text())["stages"] == list(stages.values())


def test_a_bad_variant_override_names_the_variant(experts_path, tiny_model_dir, tmp_path):
    config = tiny_config(tmp_path, experts_path, tiny_model_dir, name="badvariant")
    with pytest.raises(ValueError, match="variants.oops.label"):  # at start-up, before any stage
        EvolveConfig.model_validate({**config.model_dump(), "variants": {"oops": {"label": {"estimator": "nosuch"}}}})


def test_a_finished_run_extends_with_a_baseline_a_variant_and_an_iteration(experts_path, tiny_model_dir, tmp_path):
    """--resume with more iterations, baselines or variants runs only the new stages."""
    config = tiny_config(tmp_path, experts_path, tiny_model_dir, name="extend")
    config = config.model_copy(update={"iterations": 1, "eval": config.eval.model_copy(update={"splits": ["seen"]})})
    run_evolve(config, log=lambda m: None)
    root = tmp_path / "runs" / "extend"
    before = json.loads((root / "manifest.json").read_text())["stages"]
    wider = EvolveConfig.model_validate({
        **config.model_dump(), "iterations": 2, "baselines": ["rft"],
        "rft": {**config.rft.model_dump(), "max_steps": 1, "grad_accum_steps": 1, "tokens_per_batch": 2048,
                "tensorboard": False},
        "variants": {"q_minus_v": {"label": {"estimator": "q_minus_v"}}}})
    with pytest.raises(Exception, match="already holds a run"):
        run_evolve(wider, log=lambda m: None)
    table = run_evolve(wider, resume=True, log=lambda m: None)
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["stages"][:len(before)] == before  # recorded stages kept as they were, not rerun
    assert [s["name"] for s in manifest["stages"][len(before):]] == [
        "iter_1/rft/policy", "iter_1/rft/probe", "iter_1/rft/eval_seen", "iter_1/q_minus_v/label",
        "iter_1/q_minus_v/policy", "iter_1/q_minus_v/probe", "iter_1/q_minus_v/eval_seen", "iter_2/rollouts",
        "iter_2/buffer", "iter_2/critic", "iter_2/label", "iter_2/policy", "iter_2/probe", "iter_2/eval_seen"]
    timings = [json.loads(line) for line in (root / "timings.jsonl").read_text().splitlines()]
    timed = [t["stage"] for t in timings]
    assert timed.count("bc") == 1 and timed.count("iter_1/policy") == 1
    if sys.platform == "linux":  # each stage's own peak resident memory (a model was loaded: over 50 MB)
        assert all(t["peak_rss_mb"] > 50 for t in timings if t["stage"].endswith(("bc", "policy")))
        assert "peak_rss_mb" not in json.dumps(manifest)  # it depends on the machine: never in the manifest
    assert manifest["extensions"][0]["changes"] == ["iterations 1 -> 2", "baselines + rft", "variants + q_minus_v"]
    assert [row["policy"] for row in table] == ["BC", "Q-Evolve iter 1", "RFT (iter 1 buffer)", "q_minus_v (iter 1)",
                                                "Q-Evolve iter 2"]
    # a change to what a recorded stage read is still refused
    with pytest.raises(Exception, match="started with label.gae_lambda"):
        run_evolve(EvolveConfig.model_validate({**wider.model_dump(), "label": {**wider.label.model_dump(),
                                                                                "gae_lambda": 0.5}}),
                   resume=True, log=lambda m: None)


def test_make_quickstart_compares_the_run_its_config_writes():
    """The README's main job (`make quickstart`) runs one evolve config and then compares that config's run folder."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    recipe = (root / "Makefile").read_text().split("\nquickstart:", 1)[1].split("\n\n", 1)[0]
    config_path = re.search(r"qevolve evolve --config (\S+)", recipe).group(1)
    compared = re.search(r"qevolve compare (\S+)", recipe).group(1)
    config = load_config(EvolveConfig, root / config_path)
    assert compared == f"runs/{config.name}"
    assert config.env == "webshop" and "rft" in config.baselines  # the SFT, RFT and Q-Evolve rows the README shows
    assert re.search(rf"qevolve data expert {config.env}\b", recipe)  # its demonstrations are built first


def test_rft_trains_on_the_won_episodes_of_the_buffer_only(alfworld_experts, tiny_model_dir, tmp_path):
    """RFT = behaviour cloning on the buffer's won episodes (expert and self); its first loss is their
    mean agent-token NLL under the starting policy, not that of the buffer with its failures."""
    import copy

    from qevolve.evolve.loop import rft_config
    from qevolve.policy.bc import evaluate_nll, prepare_sequences, run_bc
    from qevolve.models.loading import ModelConfig, load_policy
    from qevolve.prompting import PromptBuilder

    expert, won, lost, failed = (copy.deepcopy(ep) for ep in alfworld_experts[:4])
    for ep in (won, lost, failed):
        ep.source = "self"
    lost.won, lost.score = False, 0.0
    failed.won, failed.score, failed.failed, failed.failure_reason = False, 0.0, True, "step timeout"
    buffer_file = write_episodes(tmp_path / "buffer.parquet", [expert, won, lost, failed])
    config = load_config(EvolveConfig, None, [
        f"model.name_or_path={tiny_model_dir}", "model.precision=fp32", "model.device=cpu", "model.lora.enabled=false",
        "prompt.max_prompt_tokens=1024", "prompt.reserve_action_tokens=16", "progress=false",
        "rft.max_steps=1", "rft.grad_accum_steps=1", "rft.tokens_per_batch=65536", "rft.tensorboard=false",
        "rft.optim.lr=1e-9"])
    rft = rft_config(config, str(tiny_model_dir), buffer_file, tmp_path / "rft", seed=0)
    assert rft.data.only_won and not rft.data.include_failed and rft.data.num_demonstrations is None
    result = run_bc(rft, log=lambda m: None)
    assert result.steps == 1 and len(result.losses) == 1

    policy = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu"),
                         trainable=False)
    builder = PromptBuilder.for_environment(policy.tokenizer, config.prompt, "alfworld")

    def nll(episodes):
        return evaluate_nll(policy, prepare_sequences(episodes, builder), 65536)["agent_nll"]

    # one micro-batch holds the whole data: the step's loss is the mean NLL over exactly the won episodes
    assert result.train_sequences == len(prepare_sequences([expert, won], builder))
    assert result.losses[0] == pytest.approx(nll([expert, won]), rel=1e-4)
    assert abs(nll([expert, won, lost]) - nll([expert, won])) > 1e-3  # so the check can tell them apart


def test_seed_replicates_run_one_resumable_run_per_seed(experts_path, tiny_model_dir, tmp_path, capsys, monkeypatch):
    from qevolve import cli
    from qevolve.evolve.loop import seed_replicates

    base = tiny_config(tmp_path, experts_path, tiny_model_dir, name="rep")
    overrides = ["name=rep", f"runs_dir={tmp_path / 'runs'}", "iterations=0", "progress=false", "num_threads=1",
                 f"model.name_or_path={tiny_model_dir}", "model.precision=fp32", "model.device=cpu",
                 "prompt.max_prompt_tokens=1024", "prompt.reserve_action_tokens=16",
                 f"bc.data.train_path={experts_path}", "bc.max_steps=2", "bc.grad_accum_steps=1",
                 "bc.tokens_per_batch=2048", "bc.tensorboard=false", "eval.splits=[seen]", "eval.limit=1",
                 "eval.agent.max_turns=2", "eval.agent.max_new_tokens=8", "probe.states=0"]

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["qevolve", "evolve", *overrides, *args])
        capsys.readouterr()
        try:
            cli.main()
        except SystemExit as stop:
            assert stop.code in (None, 0), capsys.readouterr().err
        return capsys.readouterr().out

    out = run("--seeds", "0-1")
    runs = tmp_path / "runs"
    assert sorted(p.name for p in runs.iterdir()) == ["rep-s0", "rep-s1"]
    manifests = [json.loads((runs / f"rep-s{s}" / "manifest.json").read_text()) for s in (0, 1)]
    assert [m["seed"] for m in manifests] == [0, 1]
    assert [[st["name"] for st in m["stages"]] for m in manifests] == [["bc", "bc/eval_seen"]] * 2  # probe.states=0: no probe
    assert all(m["config"]["seeds"] is None and m["config"]["name"] == f"rep-s{s}" for s, m in zip((0, 1), manifests))
    digests = [next(st["digests"] for st in m["stages"] if st["name"] == "bc") for m in manifests]
    assert digests[0] != digests[1]  # another seed: another BC policy
    assert "== seed 1 (2 of 2)" in out and f"qevolve compare {runs / 'rep-s0'} {runs / 'rep-s1'}" in out
    assert f"qevolve export {runs / 'rep-s0'} {runs / 'rep-s1'} --output results/" in out
    # one more seed with --resume: the finished ones are kept as they are, only the new one runs
    before = (runs / "rep-s0" / "manifest.json").read_text()
    out = run("--seeds", "0,1,2", "--resume")
    assert (runs / "rep-s0" / "manifest.json").read_text() == before
    assert json.loads((runs / "rep-s2" / "manifest.json").read_text())["seed"] == 2
    assert [c.name for c in seed_replicates(base.model_copy(update={"seeds": [3, 1]}))] == ["rep-s3", "rep-s1"]
    with pytest.raises(ValueError, match="each seed once"):
        seed_replicates(base.model_copy(update={"seeds": [1, 1]}))
    with pytest.raises(ValueError, match="seed_replicates"):
        run_evolve(base.model_copy(update={"seeds": [0, 1]}))


@pytest.mark.parametrize("text, seeds", [("0-4", [0, 1, 2, 3, 4]), ("3", [3]), ("0,2,5", [0, 2, 5]), ("2-2", [2])])
def test_seeds_option_forms(text, seeds):
    from qevolve.cli import parse_seeds

    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["4-1", "a-b", "0,x", ""])
def test_bad_seeds_option_is_a_clear_error(text):
    import typer

    from qevolve.cli import parse_seeds

    with pytest.raises(typer.BadParameter, match="FIRST-LAST"):
        parse_seeds(text)
