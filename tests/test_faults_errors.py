"""Bad inputs give one-line errors (exit 2) that name the file or field, before any work is done.

Every case runs the real command line (``qevolve.cli.main``) in this process. The table of cases,
commands and messages is docs/errors.md: ``QEVOLVE_WRITE_DOCS=1 pytest tests/test_faults_errors.py``
rewrites it, and without the variable the test fails if the committed file differs.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from qevolve import cli
from qevolve.config import load_config
from qevolve.evolve.loop import EvolveConfig
from qevolve.evolve.run_dir import RunDirectory

ENV = "qevolve.environments.testing:CounterEnv"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def run_cli(args: list[str], capsys, monkeypatch) -> tuple[int, str, float]:
    monkeypatch.setattr(sys, "argv", ["qevolve", *args])
    capsys.readouterr()
    started = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    seconds = time.perf_counter() - started
    return exit_info.value.code, capsys.readouterr().err, seconds


def truncated_copy(model_dir: Path, target: Path) -> Path:
    shutil.copytree(model_dir, target)
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    return target


@pytest.fixture
def case_env(tmp_path, tiny_model_dir, monkeypatch):
    """A tiny model, an experts file and a recorded run of the counter environment."""
    experts = tmp_path / "experts.parquet"
    experts.write_bytes(b"")  # only its existence is checked before the first stage
    base = [f"env={ENV}", f"model.name_or_path={tiny_model_dir}", f"bc.data.train_path={experts}",
            f"buffer.expert_path={experts}", f"runs_dir={tmp_path / 'runs'}", "name=r", "tensorboard=false",
            "critic.retrospective.enabled=false"]
    config = load_config(EvolveConfig, None, base)
    root = tmp_path / "runs" / "r"
    with RunDirectory(root, config.model_dump(mode="json"), config.seed) as run:
        def bc(workdir):
            (workdir / "final").mkdir()
            return {"policy": "final"}, {"steps": 1}
        run.run_stage("bc", {}, bc, log=lambda m: None)
    monkeypatch.chdir(tmp_path)
    return {"tmp": tmp_path, "base": base, "root": root, "model": tiny_model_dir}


def cases(env) -> list[tuple[str, list[str], str, object]]:
    """(bad input, argv, expected words in the message, setup) for every case."""
    tmp, base, root = env["tmp"], env["base"], env["root"]
    evolve = ["evolve", *base]
    cut = tmp / "cut_ckpt"

    def cut_model():
        if not cut.exists():
            truncated_copy(env["model"], cut)

    stage = tmp / "runs" / "old" / "iter_1" / "policy"

    def policy_stage():
        if not stage.exists():
            shutil.copytree(env["model"], stage / "final")

    def corrupt_manifest():
        (root / "manifest.json").write_text('{"config": {"name": ')

    def delete_output():
        shutil.rmtree(root / "bc")

    holder = {}

    def hold_lock():
        handle = open(root / ".lock", "a+")
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        handle.truncate(0)
        handle.write("4242\n")
        handle.flush()
        holder["handle"] = handle  # released before the next case

    yaml_file = tmp / "run.yaml"
    yaml_file.write_text("iterations: 1\n")
    env["release"] = lambda: holder.pop("handle").close() if "handle" in holder else None
    return [
        ("missing checkpoint folder", ["eval", "--checkpoint", "bad/no_ckpt", "--env", ENV, "--limit", "1",
                                       "--output", str(tmp / "e")], "bad/no_ckpt", None),
        ("hub name without opting in", ["eval", "--checkpoint", "HuggingFaceTB/SmolLM2-135M-Instruct", "--env", ENV,
                                        "--output", str(tmp / "e")], "model.hub=true", None),
        ("a training stage's folder, not its saved policy", ["eval", "--checkpoint", "runs/old/iter_1/policy",
                                                              "--env", ENV, "--output", str(tmp / "e")],
         "did you mean 'runs/old/iter_1/policy/final'?", policy_stage),
        ("safetensors file cut in half", ["eval", "--checkpoint", str(cut), "--env", ENV, "--output", str(tmp / "e")],
         "cut_ckpt/model.safetensors", cut_model),
        ("evolve: init_checkpoint cut in half", [*evolve, "name=r2", f"init_checkpoint={cut}"],
         "cut_ckpt/model.safetensors", cut_model),
        ("evolve: unknown rollout split", [*evolve, "name=r2", "env=alfworld", "rollout.split=nosuch"],
         "rollout.split 'nosuch'", None),
        ("evolve: unknown evaluation split", [*evolve, "name=r2", "env=alfworld", "eval.splits=[seen,nosuch]"],
         "eval.splits[1] 'nosuch'", None),
        ("evolve: unknown environment", [*evolve, "name=r2", "env=nosuch"], "env 'nosuch'", None),
        ("evolve: missing expert data", [*evolve, "name=r2", "buffer.expert_source=extra",
                                          "buffer.expert_path=nowhere.parquet"], "no such file or folder", None),
        ("evolve: buffer experts from another store than BC's", [*evolve, "name=r2", "buffer.expert_path=other.parquet"],
         "buffer.expert_source=extra", None),
        ("evolve: environment without r_aux penalties", [*evolve, "name=r2", "critic.retrospective.enabled=true"],
         "critic.retrospective.penalties", None),
        ("evolve: bad override value", [*evolve, "name=r2", "iterations=two"], "override 'iterations=two'", None),
        ("evolve: bad override with a YAML file", ["evolve", "--config", str(yaml_file), *base, "name=r2",
                                                   "critic.epochs=-1"], "override 'critic.epochs=-1'", None),
        ("evolve: rerun without --resume", evolve, "manifest.json", None),
        ("evolve: --resume with a different config", [*evolve, "--resume", "seed=7"], "seed=0", None),
        ("evolve: corrupt manifest.json", [*evolve, "--resume"], "manifest.json", corrupt_manifest),
        ("evolve: a second process on the same run", [*evolve, "--resume"], "another qevolve process", hold_lock),
        ("evolve: a recorded stage's output deleted", [*evolve, "--resume"], "--redo bc", delete_output),
        ("evolve: --redo of a stage never recorded", [*evolve, "--redo", "iter_9/critic"], "iter_9/critic", None),
    ]


def normalise(text: str, env) -> str:
    for path, name in ((env["model"], "<model>"), (env["tmp"], "<tmp>")):
        text = text.replace(str(path.resolve()), name).replace(str(path), name)
    text = re.sub(r"\d+ bytes", "N bytes", text)
    text = re.sub(r"needs \d+\)", "needs M)", text)
    return text


def render(rows: list[tuple[str, str, str]], base: str) -> str:
    lines = ["# Errors from bad inputs", "",
             "Generated by `tests/test_faults_errors.py` (`QEVOLVE_WRITE_DOCS=1 pytest tests/test_faults_errors.py`",
             "rewrites it; the test fails when this file and the messages differ). Every case exits with",
             "code 2 and prints one line on stderr, before any stage runs. `<tmp>` is the test's scratch",
             "folder, `<model>` a tiny local model; the fixed run has `runs/r/manifest.json` with stage `bc`.",
             f"Every `evolve` command below also passes `{base}`.", "", "| bad input | command | message (stderr) |", "|---|---|---|"]
    for label, command, message in rows:
        message = message.replace("|", "/").replace("`", "'")
        lines.append(f"| {label} | `{command}` | `{message}` |")
    return "\n".join(lines) + "\n"


def short_command(argv: list[str], env) -> str:
    keep = []
    for arg in argv:
        if arg in env["base"]:
            continue
        keep.append(normalise(arg, env))
    return "qevolve " + " ".join(keep)


def test_every_bad_input_is_a_one_line_error_naming_the_problem(case_env, alfworld_installed, capsys, monkeypatch):
    rows = []
    manifest = case_env["root"] / "manifest.json"
    saved = manifest.read_text()
    for label, argv, expected, setup in cases(case_env):
        case_env["release"]()
        manifest.write_text(saved)
        if setup is not None:
            setup()
        code, err, seconds = run_cli(argv, capsys, monkeypatch)
        assert code == 2, (label, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (label, err)
        assert expected in lines[0], (label, lines[0])
        assert seconds < 60, (label, seconds)  # no work, no network
        assert not (case_env["tmp"] / "runs" / "r2" / "manifest.json").exists(), label  # nothing recorded
        rows.append((label, short_command(argv, case_env), normalise(lines[0], case_env)))
    text = render(rows, normalise(" ".join(case_env["base"]), case_env))
    if os.environ.get("QEVOLVE_WRITE_DOCS") == "1":
        DOCS.write_text(text)
    assert DOCS.read_text() == text, "docs/errors.md is stale: rerun with QEVOLVE_WRITE_DOCS=1"


def test_no_network_for_a_missing_local_name(monkeypatch):
    """A name that is not a local folder never reaches transformers' download code without hub: true."""
    import transformers

    from qevolve.models.loading import ModelConfig, load_policy

    def no_download(*args, **kwargs):
        raise AssertionError("tried to download")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_download)
    for name in ("bad/no_ckpt", "some-org/some-model", "./missing"):
        with pytest.raises(ValueError, match="folder not found"):
            load_policy(ModelConfig(name_or_path=name, device="cpu"))
    with pytest.raises(ValueError, match="folder not found"):
        load_policy(ModelConfig(name_or_path="./missing", hub=True, device="cpu"))


def test_local_models_load_with_local_files_only(tiny_model_dir, monkeypatch):
    import transformers

    from qevolve.models.loading import ModelConfig, load_policy

    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.append(kwargs.get("local_files_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    load_policy(ModelConfig(name_or_path=str(tiny_model_dir), device="cpu", precision="fp32"), trainable=False)
    assert seen == [True]


def test_whole_safetensors_pass_the_check(tiny_model_dir, tmp_path):
    from qevolve.models.loading import check_checkpoint, check_safetensors

    check_checkpoint(str(tiny_model_dir))
    check_safetensors(tiny_model_dir / "model.safetensors")
    cut = truncated_copy(tiny_model_dir, tmp_path / "cut")
    with pytest.raises(ValueError, match=re.escape(str(cut / "model.safetensors"))):
        check_checkpoint(str(cut))


def test_overrides_are_blamed_not_the_yaml_file(tmp_path):
    from qevolve.config import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text("iterations: 1\ncritic:\n  epochs: 2\n")
    with pytest.raises(ConfigError, match=r"^override 'critic.epochs=x': field 'critic.epochs'"):
        load_config(EvolveConfig, path, ["critic.epochs=x"])
    path.write_text("iterations: one\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: field 'iterations'"):
        load_config(EvolveConfig, path, ["critic.epochs=3"])
    path.write_text("iterations: 1\n")
    with pytest.raises(ConfigError, match=r"^override 'critic.epoch=3': unknown field 'critic.epoch'"):
        load_config(EvolveConfig, path, ["critic.epoch=3"])
