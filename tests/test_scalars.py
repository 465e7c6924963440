"""Per-step training scalars: the scalars.jsonl file, reading stage folders, and the run-level loggers."""

import json
import sys
import types

import pytest

from qevolve.scalars import SCALARS_FILE, ScalarLog, read_event_scalars, read_scalars, stage_scalars


def test_a_resumed_log_drops_the_steps_after_its_checkpoint(tmp_path):
    path = tmp_path / SCALARS_FILE
    first = ScalarLog(path)
    for step in range(1, 6):
        first.write(step, {"train/loss": 1.0 / step})
    first.close()  # "killed" after step 5; the last checkpoint was step 3
    resumed = ScalarLog(path, resume_step=3)
    for step in range(4, 7):
        resumed.write(step, {"train/loss": 10.0 + step})
    resumed.close()
    assert read_scalars(path) == {"train/loss": [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 14.0), (5, 15.0), (6, 16.0)]}
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    ScalarLog(path).close()  # a fresh start forgets an earlier attempt
    assert read_scalars(path) == {}


def test_reading_keeps_the_last_value_per_step_and_skips_a_cut_line(tmp_path):
    path = tmp_path / SCALARS_FILE
    path.write_text('{"step": 2, "a": 1.0, "b": 5}\n{"step": 1, "a": 3.0}\n{"step": 2, "a": 2.0}\n'
                    '{"step": 3, "a": NaN}\n{"step": 4, "a": 7')
    assert read_scalars(path) == {"a": [(1, 3.0), (2, 2.0)], "b": [(2, 5.0)]}


def test_stage_folders_policy_critic_and_tensorboard_only(tmp_path):
    policy = tmp_path / "policy"
    log = ScalarLog(policy / SCALARS_FILE)
    log.write(1, {"policy/kl_ref": 0.5})
    log.close()
    assert stage_scalars(policy) == ({"policy/kl_ref": [(1, 0.5)]}, "step")

    critic = tmp_path / "critic"
    critic.mkdir()
    rows = [{"epoch": e, "steps": 8 * e, "loss_v": 1.0 / e, "explained_variance": 0.1 * e, "seconds": 0.3}
            for e in (1, 2)]
    (critic / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    series, axis = stage_scalars(critic)
    assert axis == "epoch"
    assert series == {"critic/explained_variance": [(1, 0.1), (2, 0.2)], "critic/loss_v": [(1, 1.0), (2, 0.5)]}

    # a run made before scalars.jsonl: its TensorBoard event files, every point (not a sample)
    from torch.utils.tensorboard import SummaryWriter

    old = tmp_path / "old"
    writer = SummaryWriter(str(old / "tensorboard"))
    for step in range(1, 301):
        writer.add_scalar("train/loss", 1.0 / step, step)
    writer.close()
    series, axis = stage_scalars(old)
    assert axis == "step" and len(series["train/loss"]) == 300
    assert series["train/loss"][:2] == [(1, 1.0), (2, pytest.approx(0.5))]
    assert stage_scalars(tmp_path / "nothing") == ({}, "step")


def test_the_run_level_loggers_send_step_curves_to_tensorboard_and_wandb(tmp_path, monkeypatch):
    from qevolve.evolve.loop import EvolveConfig, _Loggers

    calls = []

    class FakeRun:
        def log(self, values):
            calls.append(("log", dict(values)))

        def define_metric(self, name, step_metric=None):
            calls.append(("define", name, step_metric))

        def finish(self):
            calls.append(("finish",))

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: FakeRun()))
    root = tmp_path / "run"
    loggers = _Loggers(EvolveConfig(name="demo", tensorboard=True, wandb=True), root)
    stage = root / "iter_1" / "policy"
    log = ScalarLog(stage / SCALARS_FILE)
    for step in (1, 2, 3):
        log.write(step, {"policy/kl_ref": 0.1 * step, "policy/loss": 1.0 - 0.1 * step})
    log.close()
    loggers.log("iter_1/policy", 1, {"steps": 3})
    loggers.log_steps("iter_1/policy", stage)
    loggers.log_steps("iter_1/eval_seen", root / "iter_1" / "eval_seen")  # no curves: nothing logged
    (root / "iter_1" / "critic").mkdir(parents=True)
    (root / "iter_1" / "critic" / "metrics.jsonl").write_bytes(b"\xff\xfe not text")  # a warning, the run goes on
    warnings = []
    loggers.log_steps("iter_1/critic", root / "iter_1" / "critic", warn=warnings.append)
    assert len(warnings) == 1 and "[iter_1/critic] its per-step curves were not logged" in warnings[0]
    loggers.close()

    events = read_event_scalars(root / "tensorboard")
    assert events["iter_1/policy/policy/kl_ref"] == [(1, pytest.approx(0.1)), (2, pytest.approx(0.2)),
                                                    (3, pytest.approx(0.3))]
    assert events["policy/steps"] == [(1, 3.0)]  # the per-stage point is still there
    assert ("define", "iter_1/policy/policy/kl_ref", "iter_1/policy/step") in calls
    step_logs = [c[1] for c in calls if c[0] == "log" and "iter_1/policy/step" in c[1]]
    assert [entry["iter_1/policy/step"] for entry in step_logs] == [1, 2, 3]
    assert step_logs[1]["iter_1/policy/policy/loss"] == pytest.approx(0.8)
    assert calls[-1] == ("finish",)


def test_behaviour_cloning_logs_each_step_once_across_a_resume(tiny_model_dir, alfworld_experts, tmp_path):
    """The scalars.jsonl of an interrupted and resumed BC run is that of an uninterrupted one."""
    from qevolve.buffer.store import write_episodes
    from qevolve.policy.bc import run_bc
    from test_bc import bc_config

    data = write_episodes(tmp_path / "experts.parquet", alfworld_experts)

    def config(output, **overrides):
        cfg = bc_config(tiny_model_dir, data, output, max_steps=5, save_every=2, tensorboard=False, **overrides)
        cfg.model.lora.enabled = False
        return cfg

    run_bc(config(tmp_path / "straight"), log=lambda m: None)
    run_bc(config(tmp_path / "crash", stop_after_steps=3), log=lambda m: None)  # step 3 is lost: resumes at 2
    run_bc(config(tmp_path / "crash"), log=lambda m: None)
    straight, resumed = read_scalars(tmp_path / "straight" / SCALARS_FILE), read_scalars(tmp_path / "crash" / SCALARS_FILE)
    assert [step for step, _ in straight["train/loss"]] == [1, 2, 3, 4, 5]
    assert straight["train/loss"] == resumed["train/loss"]
    assert [step for step, _ in resumed["eval/agent_nll"]] == [0, 5]  # held-out NLL before and after
    assert not (tmp_path / "straight" / "tensorboard").exists()  # the file does not need TensorBoard
