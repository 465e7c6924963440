"""``qevolve evolve --dry-run``: every stage's config built and validated, nothing run, loaded or written."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from qevolve.cli import app
from qevolve.config import load_config
from qevolve.evolve.loop import EvolveConfig, dry_run_evolve, run_evolve, seed_replicates

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def evolve_configs() -> list[Path]:
    """The shipped evolve configs (as tests/test_config.py enumerates them)."""
    return [f for f in sorted(CONFIGS.glob("**/*.yaml")) if f.parent.name in ("configs", "cpu", "gpu", "ablations")
            and f.stem not in ("bc", "critic", "dpo", "label")]


@pytest.fixture
def nothing_loaded(monkeypatch, tmp_path):
    """No model, tokenizer or environment may be touched; the working folder is an empty tmp_path.

    The refusing stand-in replaces each guarded function in its own module and wherever a loaded qevolve
    module bound it by name. The modules a dry run imports lazily (the run-environment check reads the
    generation backend) are imported first: imported while the patch is in force, they would keep the
    stand-in after it is undone, and later tests would load nothing."""
    import importlib
    import sys

    import transformers

    import qevolve.environments.play as play
    import qevolve.models.loading as loading

    for lazily_imported in ("qevolve.rollouts.agent", "qevolve.rollouts.run"):
        importlib.import_module(lazily_imported)

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run loaded a model or touched an environment")

    guarded = {id(getattr(module, name)): name for module, name in
               ((loading, "load_policy"), (loading, "check_checkpoint"), (play, "list_tasks"))}
    for name, module in list(sys.modules.items()):
        if name == "qevolve" or name.startswith("qevolve."):
            for attr, value in list(vars(module).items()):
                if id(value) in guarded:
                    monkeypatch.setattr(module, attr, refuse)
    for module in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        monkeypatch.setattr(module, "from_pretrained", refuse)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("path", evolve_configs(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_evolve_config_passes_the_dry_run(path, nothing_loaded):
    config = seed_replicates(load_config(EvolveConfig, path, [f"runs_dir={nothing_loaded / 'runs'}"]))[0]
    lines: list[str] = []
    planned = dry_run_evolve(config, log=lines.append)
    names = [stage.name for stage in planned]
    assert names[0] == "bc" and len(set(names)) == len(names)
    assert any(name.startswith("bc/eval_") for name in names)
    if config.iterations:
        assert f"iter_{config.iterations}/policy" in names
    processes = config.distributed.processes()
    assert dict((s.name, s.processes) for s in planned)["bc"] == processes
    for name in config.baselines:
        if name in ("grpo", "ppo"):
            assert f"iter_1/{name}/round_1/policy" in names and f"iter_1/{name}/round_2/policy" not in names
            assert any(f"[iter_1/{name}] rounds until the budget" in line for line in lines)
    assert list(nothing_loaded.iterdir()) == []  # no run folder, nothing written


def test_the_cli_lists_the_stages_with_their_process_counts(nothing_loaded):
    result = CliRunner().invoke(app, ["evolve", "--config", str(CONFIGS / "ablations" / "ppo.yaml"), "--dry-run",
                                      "distributed.nproc_per_node=4", "baselines=[ppo,eto]"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "  bc  (training: 4 processes)" in lines and "  iter_1/critic  (training: 4 processes)" in lines
    assert "  iter_1/eto/policy  (training: 1 process)" in lines  # DPO trains in one process
    assert "  iter_1/ppo/round_1/value" in lines and "  bc/eval_seen" in lines
    assert any("rounds until the budget" in line for line in lines)
    assert lines[-1].startswith(f"{len([line for line in lines if line.startswith('  ')])} stages")
    assert list(nothing_loaded.iterdir()) == []


def _invalid_policy_config() -> EvolveConfig:
    """A config whose policy section escaped validation (model_copy does not validate): epochs 0."""
    config = load_config(EvolveConfig, CONFIGS / "cpu" / "webshop-quick.yaml")
    return config.model_copy(update={"policy": config.policy.model_copy(update={"epochs": 0})})


def test_an_invalid_stage_config_fails_naming_the_stage_and_field(nothing_loaded):
    with pytest.raises(ValueError, match=r"^stage iter_1/policy: epochs: Input should be greater than") as info:
        run_evolve(_invalid_policy_config(), dry_run=True, log=lambda line: None)
    assert "\n" not in str(info.value)
    assert list(nothing_loaded.iterdir()) == []


def test_the_cli_reports_an_invalid_stage_config_in_one_line_with_exit_2(nothing_loaded, monkeypatch, capsys):
    import sys

    import qevolve.config
    from qevolve.cli import main

    monkeypatch.setattr(qevolve.config, "load_config", lambda *args, **kwargs: _invalid_policy_config())
    monkeypatch.setattr(sys, "argv", ["qevolve", "evolve", "--dry-run"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: stage iter_1/policy: epochs: "), errors
    assert list(nothing_loaded.iterdir()) == []


def _recorded_run(root: Path, config: EvolveConfig, stages: list[str]) -> Path:
    """A run folder as `qevolve evolve` leaves it after completing ``stages`` (the manifest only)."""
    import json

    from qevolve.evolve.loop import environment_of, recorded_config
    from qevolve.evolve.run_dir import RunDirectory

    run = root / config.name
    with RunDirectory(run, recorded_config(config), config.seed, environment=environment_of(config)):
        pass
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["stages"] = [{"name": name, "inputs": {}, "outputs": {}, "metrics": {}} for name in stages]
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def _folder_state(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def test_a_dry_run_of_a_resume_marks_the_recorded_stages_and_checks_the_config_read_only(nothing_loaded):
    from qevolve.evolve.run_dir import RunDirectory, RunError

    quick = CONFIGS / "cpu" / "webshop-quick.yaml"
    config = load_config(EvolveConfig, quick, [f"runs_dir={nothing_loaded}", "baselines=[]"])
    recorded = ["bc", "bc/probe", "bc/eval_test", "iter_1/rollouts", "iter_1/buffer"]
    run = _recorded_run(nothing_loaded, config, recorded)
    before = _folder_state(run)

    planned = dry_run_evolve(config, log=lambda line: None, resume=True)
    assert [s.name for s in planned if s.done] == recorded
    assert [s.name for s in planned if not s.done][:2] == ["iter_1/critic", "iter_1/label"]
    # --redo forgets the named stage and every later one
    planned = dry_run_evolve(config, log=lambda line: None, redo="bc/eval_test")
    assert [s.name for s in planned if s.done] == ["bc", "bc/probe"]
    # a config that adds a baseline extends the run; the line says so, and its stages are still to run
    lines: list[str] = []
    extended = load_config(EvolveConfig, quick, [f"runs_dir={nothing_loaded}", "baselines=[rft]"])
    planned = dry_run_evolve(extended, log=lines.append, resume=True)
    assert "  (the config extends the run: baselines + rft)" in lines
    assert {s.name: s.done for s in planned}["iter_1/rft/policy"] is False
    # the run holds its lock meanwhile (a run in progress): the preview takes none, so it still answers
    with RunDirectory(run, {}, 0, resume=True, extend=lambda recorded, new: (new, [])):
        assert len([s for s in dry_run_evolve(config, log=lambda line: None, resume=True) if s.done]) == len(recorded)
    # what the run itself would refuse, the dry run refuses alike, in one line
    changed = load_config(EvolveConfig, quick, [f"runs_dir={nothing_loaded}", "baselines=[]", "policy.optim.lr=3e-5"])
    with pytest.raises(RunError, match=r"started with policy\.optim\.lr=1e-05, this config has policy\.optim\.lr=3e-05"):
        dry_run_evolve(changed, log=lambda line: None, resume=True)
    with pytest.raises(RunError, match="already holds a run; pass --resume"):
        dry_run_evolve(config, log=lambda line: None)
    with pytest.raises(RunError, match="--redo iter_1/critic: .* records no such stage"):
        dry_run_evolve(config, log=lambda line: None, redo="iter_1/critic")
    assert _folder_state(run) == before  # nothing written, no lock file left behind by the previews

    # a run that started in another environment: the dry run warns, as the resume would
    import json

    manifest = json.loads((run / "manifest.json").read_text())
    field = sorted(manifest["environment"])[0]
    manifest["environment"][field] = "another machine's"
    (run / "manifest.json").write_text(json.dumps(manifest))
    lines = []
    dry_run_evolve(config, log=lines.append, resume=True)
    assert any(line.startswith("  WARNING: the run started in another environment") and field in line for line in lines)


def test_the_cli_counts_what_a_resume_would_skip_and_run(nothing_loaded):
    quick = CONFIGS / "cpu" / "webshop-quick.yaml"
    config = load_config(EvolveConfig, quick, [f"runs_dir={nothing_loaded}"])
    _recorded_run(nothing_loaded, config, ["bc", "bc/probe"])
    result = CliRunner().invoke(app, ["evolve", "--config", str(quick), "--dry-run", "--resume",
                                      f"runs_dir={nothing_loaded}"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "  bc  (training: 1 process)  done earlier" in lines and "  bc/eval_test" in lines
    total = len([line for line in lines if line.startswith("  ") and not line.startswith("  (")])
    assert lines[-1].startswith(f"{total} stages, 2 done earlier and {total - 2} to run")
    # a fresh folder: every stage runs
    result = CliRunner().invoke(app, ["evolve", "--config", str(quick), "--dry-run", "--resume",
                                      f"runs_dir={nothing_loaded / 'elsewhere'}"])
    assert result.exit_code == 0 and "  (no run there yet: every stage runs)" in result.output.splitlines()
    assert not (nothing_loaded / "elsewhere").exists()


def test_a_dry_run_prices_the_stages_left_by_the_times_its_seed_replicates_recorded(nothing_loaded):
    import json

    quick = CONFIGS / "cpu" / "webshop-quick.yaml"

    def config(name: str, *more: str) -> EvolveConfig:
        return load_config(EvolveConfig, quick, [f"runs_dir={nothing_loaded}", f"name={name}", "baselines=[]", *more])

    # seed 0 recorded its stages' times; a stage redone later counts with its last time
    seed0 = _recorded_run(nothing_loaded, config("quick-s0"), ["bc", "bc/probe"])
    lines = [{"stage": "bc", "seconds": 999.0}, {"stage": "bc", "seconds": 600.0}, {"stage": "bc/probe", "seconds": 60.0},
             {"stage": "iter_1/policy", "seconds": 1200.0}]
    (seed0 / "timings.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"stage": "bc/ev')
    # seed 1 is new, with a variant no run has timed: its policy is priced as every iter_1/*/policy was
    log: list[str] = []
    planned = dry_run_evolve(config("quick-s1", "variants.floor.policy.advantage_floor=0"), log=log.append, resume=True)
    estimates = {stage.name: stage.estimate_s for stage in planned}
    assert estimates["bc"] == 600.0 and estimates["bc/probe"] == 60.0 and estimates["iter_1/policy"] == 1200.0
    assert estimates["iter_1/floor/policy"] == 1200.0 and estimates["iter_1/critic"] is None
    assert "  bc  (training: 1 process)  about 10m00s" in log
    assert "  iter_1/floor/policy  (training: 1 process)  about 20m00s (as its kind)" in log
    assert log[-1].startswith("  (to run: about 51m00s for 4 of the") and "quick-s0 recorded them" in log[-1]
    # a second replicate: the median of the two; and seed 0's own resume prices only what it has left
    seed2 = _recorded_run(nothing_loaded, config("quick-s2"), ["bc"])
    (seed2 / "timings.jsonl").write_text(json.dumps({"stage": "bc", "seconds": 800.0}) + "\n")
    assert {s.name: s.estimate_s for s in dry_run_evolve(config("quick-s1"), log=lambda line: None)}["bc"] == 700.0
    done0 = {s.name: (s.done, s.estimate_s) for s in dry_run_evolve(config("quick-s0"), log=lambda line: None,
                                                                        resume=True)}
    assert done0["bc"] == (True, None) and done0["iter_1/policy"] == (False, 1200.0)
    # a run of another protocol in the same folder is not read
    other = _recorded_run(nothing_loaded, config("quicker-s0"), ["bc"])
    (other / "timings.jsonl").write_text(json.dumps({"stage": "bc", "seconds": 5.0}) + "\n")
    assert {s.name: s.estimate_s for s in dry_run_evolve(config("quick-s1"), log=lambda line: None)}["bc"] == 700.0
