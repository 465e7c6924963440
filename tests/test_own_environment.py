"""A user's own environment, first class: docs/own-environment.md runs as written (its files and
commands, worker processes importing the user's module by name), the constructor contract is checked
up front, and a stage whose episodes all failed stops loudly instead of scoring 0."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qevolve.buffer.store import read_episodes

DOC = Path(__file__).resolve().parents[1] / "docs" / "own-environment.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def doc_blocks() -> list[tuple[str, str]]:
    """(language, body) of every fenced block of the doc, in order."""
    return FENCE.findall(DOC.read_text())


def doc_files() -> dict[str, str]:
    """The files the doc asks to save: blocks whose first line is ``# file: NAME``."""
    files = {}
    for _, body in doc_blocks():
        first = body.splitlines()[0]
        if first.startswith("# file: "):
            files[first[len("# file: "):].strip()] = body
    return files


def doc_commands() -> list[str]:
    return [line.strip() for lang, body in doc_blocks() if lang == "bash"
            for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def qevolve(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The `qevolve` command as a user runs it: the installed script, whose sys.path does not hold the
    current folder (so this tests that the user's module is found from there anyway)."""
    import qevolve

    script = Path(sys.executable).parent / "qevolve"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "qevolve.cli"]
    # the qevolve package under test, whatever the current folder (a relative PYTHONPATH would not follow cwd)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(qevolve.__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(command + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def write_game(folder: Path, module: str = "rooms_game", extra: str = "") -> Path:
    """The doc's game module saved as ``folder/module.py`` (plus ``extra`` code), importable from ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(doc_files()["rooms_game.py"] + textwrap.dedent(extra))
    return folder


def test_the_doc_runs_as_written_from_the_game_to_evolve(tmp_path):
    files = doc_files()
    assert set(files) == {"rooms_game.py", "rooms.yaml"}
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    commands = doc_commands()
    assert [c.split()[1] for c in commands] == ["env", "data", "model", "evolve", "eval"]
    outputs = []
    for command in commands:
        assert command.startswith("qevolve ")
        done = qevolve(command.split()[1:], tmp_path)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    # env play: the scripted expert wins every training task, on two worker processes
    assert re.search(r"\| rooms_game:rooms \| train \| 6 +\| 6 +\| 1\.000", outputs[0]), outputs[0]
    experts = read_episodes(tmp_path / "experts" / "rooms")
    assert len(experts) == 6 and all(ep.won and ep.source == "expert" and ep.env == "rooms_game:rooms"
                                     for ep in experts)
    root = tmp_path / "runs" / "rooms"
    stages = [s["name"] for s in json.loads((root / "manifest.json").read_text())["stages"]]
    assert stages == ["bc", "bc/probe", "bc/eval_test", "iter_1/rollouts", "iter_1/buffer", "iter_1/critic",
                      "iter_1/label", "iter_1/policy", "iter_1/probe", "iter_1/eval_test"]
    rollouts = read_episodes(root / "iter_1" / "rollouts")
    assert len(rollouts) == 6 and not any(ep.failed for ep in rollouts)  # played in the workers, none lost
    # r_aux from the penalties the class declares (the config has no entry for this environment)
    labelled = read_episodes(root / "iter_1" / "label" / "labelled.parquet")
    aux = {round(t.r_aux, 4) for ep in labelled for t in ep.turns}
    assert aux <= {0.0, -0.3, -0.2, -0.1} and aux & {-0.3, -0.2, -0.1}
    metrics = json.loads((tmp_path / "evals" / "bc-test" / "metrics.json").read_text())
    assert metrics["episodes"] == 3 and metrics["failed_episodes"] == 0


def test_the_docs_contract_error_is_the_one_raised():
    from qevolve.environments import Environment
    from qevolve.environments.base import EnvironmentContractError, check_factory

    (example,) = [body.strip() for lang, body in doc_blocks() if lang == "text" and "split=" in body]

    class RoomsEnv(Environment):  # the doc's game with a constructor that forgot split
        def __init__(self, seed: int = 0):
            pass

        def tasks(self, split):
            return []

        def reset(self, task_id):
            return ""

        def step(self, action):
            raise NotImplementedError

    with pytest.raises(EnvironmentContractError) as error:
        check_factory("rooms", RoomsEnv)
    assert f"error: {error.value}" == example


def test_a_stage_whose_episodes_all_failed_stops_and_is_not_recorded(tiny_model_dir, tmp_path):
    """The doc's example error, from evolve on the game with a broken reset; fixed, --resume runs the stage."""
    broken = "\n\ndef _broken_reset(self, task_id):\n    return str(1 / 0)\n\n\nRoomsEnv.reset = _broken_reset\n"
    write_game(tmp_path, extra=broken)
    (tmp_path / "rooms.yaml").write_text(doc_files()["rooms.yaml"])
    args = ["evolve", "--config", "rooms.yaml", "iterations=0", f"init_checkpoint={tiny_model_dir}",
            f"model.name_or_path={tiny_model_dir}"]
    done = qevolve(args, tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    (example,) = [body.strip() for lang, body in doc_blocks() if lang == "text" and "every episode failed" in body]
    assert done.stderr.strip().splitlines()[-1] == example
    manifest = tmp_path / "runs" / "rooms" / "manifest.json"
    assert [s["name"] for s in json.loads(manifest.read_text())["stages"]] == ["bc"]  # eval_test not recorded
    write_game(tmp_path)  # fixed
    done = qevolve([*args, "--resume"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    stages = json.loads(manifest.read_text())["stages"]
    assert [s["name"] for s in stages] == ["bc", "bc/eval_test"] and stages[1]["metrics"]["failed_episodes"] == 0


@pytest.fixture
def broken_game(tmp_path, monkeypatch):
    """The game with a reset that raises, as module ``broken_rooms`` (registered as ``broken``), importable
    here and in worker processes."""
    extra = """
        @register_environment("broken")
        class BrokenRooms(RoomsEnv):
            def reset(self, task_id):
                return str(1 / 0)
        """
    write_game(tmp_path / "site", "broken_rooms", extra)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return "broken_rooms:broken"


def run_cli(args: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    from qevolve import cli

    monkeypatch.setattr(sys, "argv", ["qevolve", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def test_eval_exits_non_zero_and_prints_the_first_failure(broken_game, tiny_model_dir, tmp_path, capsys, monkeypatch):
    base = ["eval", "--checkpoint", str(tiny_model_dir), "--env", broken_game, "--split", "test",
            "agent.max_turns=2", "agent.max_new_tokens=4", "prompt.max_prompt_tokens=512",
            "prompt.reserve_action_tokens=8"]
    code, out, err = run_cli([*base, "--output", str(tmp_path / "e1")], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"error: {broken_game} test: every episode failed" in err
    assert "task 'test-0': ZeroDivisionError: division by zero" in err and "remove it before running again" in err
    assert json.loads((tmp_path / "e1" / "metrics.json").read_text())["failed_episodes"] == 3
    # allowed to finish: the table shows the failed count, the first failure follows, and the exit code is 1
    code, out, err = run_cli([*base, "agent.max_failed_share=1.0", "--output", str(tmp_path / "e2")], capsys,
                             monkeypatch)
    assert code == 1 and "failed_episodes" in out
    assert "3 of 3 episodes failed; first, task 'test-0': ZeroDivisionError: division by zero" in out
    assert "every one of the 3 episodes failed" in err


def test_env_play_and_data_expert_exit_non_zero_when_every_episode_failed(broken_game, tmp_path, capsys,
                                                                            monkeypatch):
    code, out, err = run_cli(["env", "play", broken_game, "--split", "test", "--workers", "2"], capsys, monkeypatch)
    assert code == 1 and "3 of 3 episodes failed; first, task 'test-0': ZeroDivisionError" in out
    code, out, err = run_cli(["data", "expert", broken_game, "--output", str(tmp_path / "x")], capsys, monkeypatch)
    assert code == 2 and "every demonstration failed in the environment; first: failed: ZeroDivisionError" in err


def test_some_failures_below_the_limit_are_reported_not_fatal():
    from qevolve.buffer.store import Episode
    from qevolve.buffer.metrics import FailedEpisodesError, check_failed_share

    def episode(k, failed):
        return Episode(f"e{k}", f"t{k}", "env", "test", "self", failed=failed,
                       failure_reason="OSError: gone\nTraceback ..." if failed else None)

    check_failed_share([episode(0, False), episode(1, True)], 0.5, "env test")  # half: allowed
    with pytest.raises(FailedEpisodesError, match=r"^env test: 2 of 3 episodes failed \(allowed: "
                                                  r"agent.max_failed_share=0.5\); first failure, task 't1': "
                                                  r"OSError: gone$"):
        check_failed_share([episode(0, False), episode(1, True), episode(2, True)], 0.5, "env test")


def test_a_user_environment_is_found_by_name_in_worker_processes(tmp_path, monkeypatch):
    from qevolve.environments.play import play_jobs, scripted_jobs
    from qevolve.environments.pool import EnvPool

    write_game(tmp_path / "site", "worker_rooms")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = "worker_rooms:rooms"
    result = play_jobs(spec, scripted_jobs(spec, "train", "walkthrough"), split="train", num_workers=2,
                       progress=False)
    assert result.metrics["won"] == 6 and not result.failures
    with EnvPool(spec, {"split": "test"}, num_workers=2) as pool:
        # both workers built the user's game by its name (importing the module in the worker)
        first = pool.reset([(0, "test-0"), (1, "test-1")])
        assert all(first[slot].startswith("Your task is to: find the key") for slot in (0, 1)), first
        pids = set(pool.worker_pids())
    assert os.getpid() not in pids and len(pids) == 2


def test_an_installed_package_names_its_environment_by_entry_point(tmp_path, monkeypatch):
    from qevolve.environments.base import environment_names, get_factory
    from qevolve.environments.play import play_jobs, scripted_jobs

    site = write_game(tmp_path / "site", "packaged_rooms")
    dist = site / "packaged_rooms-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: packaged-rooms\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[qevolve.environments]\npackaged_rooms = packaged_rooms:RoomsEnv\n")
    monkeypatch.syspath_prepend(str(site))
    assert "packaged_rooms" in environment_names()
    assert get_factory("packaged_rooms").__name__ == "RoomsEnv"
    result = play_jobs("packaged_rooms", scripted_jobs("packaged_rooms", "test", "walkthrough"), split="test",
                       num_workers=2, progress=False)
    assert result.metrics["won"] == 3 and {ep.env for ep in result.episodes} == {"packaged_rooms"}


def test_the_constructor_contract_is_checked_before_anything_is_played(tmp_path, monkeypatch, capsys):
    from qevolve.environments import Environment
    from qevolve.environments.base import EnvironmentContractError, check_factory, register_environment
    from qevolve.environments.play import list_tasks

    class NoStep:
        def __init__(self, split="train"):
            pass

        def tasks(self, split):
            return []

        def reset(self, task_id):
            return ""

    with pytest.raises(EnvironmentContractError, match=r"environment 'x': .*NoStep has no method step\(\)"):
        check_factory("x", NoStep)

    class Abstract(Environment):
        def tasks(self, split):
            return []

    with pytest.raises(EnvironmentContractError, match=r"Abstract does not implement reset, step"):
        register_environment("abstract")(Abstract)

    def factory(seed=0):
        return None

    with pytest.raises(EnvironmentContractError, match=r"factory\(seed=0\) does not accept the keyword argument "
                                                       r"split="):
        check_factory("y", factory)
    check_factory("z", lambda **settings: None)  # keyword settings take split

    # the CLI: a module whose class lacks split is one line, exit 2, before any worker starts
    site = write_game(tmp_path / "site", "nosplit_rooms", """
        class NoSplit(RoomsEnv):
            def __init__(self, seed: int = 0):
                super().__init__()
        """)
    monkeypatch.syspath_prepend(str(site))
    code, out, err = run_cli(["env", "play", "nosplit_rooms:NoSplit", "--split", "test"], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: environment 'nosplit_rooms:NoSplit': NoSplit(seed=0) does not accept the "
                          "keyword argument split=")

    # tasks() must list strings: checked where the main process lists them
    write_game(site, "badtasks_rooms", """
        @register_environment("badtasks")
        class BadTasks(RoomsEnv):
            def tasks(self, split):
                return range(3)
        """)
    with pytest.raises(EnvironmentContractError, match=r"BadTasks.tasks\('train'\) returned range; expected a list "
                                                       r"of task id strings"):
        list_tasks("badtasks_rooms:badtasks", "train")
    # unknown module, unknown name: one line naming the spec
    with pytest.raises(KeyError, match="cannot import module 'no_such_module'"):
        list_tasks("no_such_module:rooms", "train")
    with pytest.raises(KeyError, match="module 'badtasks_rooms' neither registers an environment 'nope'"):
        list_tasks("badtasks_rooms:nope", "train")


def test_penalties_and_demonstrations_come_from_the_environment_class(tmp_path, monkeypatch):
    from qevolve.environments.experts import get_expert_source
    from qevolve.critic.retrospective import AuxPenalties, RetrospectiveConfig, penalties_for

    site = write_game(tmp_path / "site", "declared_rooms", """
        @register_environment("odd")
        class OddPenalties(RoomsEnv):
            retrospective_penalties = {"format_error": -0.5, "repeat": -0.05}

        @register_environment("typo")
        class TypoPenalties(RoomsEnv):
            retrospective_penalties = {"format_eror": -0.5}

        class NoExpert(RoomsEnv):
            expert_actions = Environment.expert_actions
        """)
    monkeypatch.syspath_prepend(str(site))
    config = RetrospectiveConfig()
    assert penalties_for("declared_rooms:odd", config) == AuxPenalties(format_error=-0.5, repeat=-0.05)
    own = RetrospectiveConfig(penalties={"declared_rooms:odd": AuxPenalties(format_error=-1.0)})
    assert penalties_for("declared_rooms:odd", own).format_error == -1.0  # the config's entry wins
    with pytest.raises(ValueError, match=r"environment 'declared_rooms:typo': retrospective_penalties.format_eror: "
                                         r"Extra inputs are not permitted"):
        penalties_for("declared_rooms:typo", config)
    with pytest.raises(ValueError, match=r"no entry for environment 'qevolve.environments.testing:QuietCounterEnv' "
                                         r"and its class declares no retrospective_penalties"):
        penalties_for("qevolve.environments.testing:QuietCounterEnv", config)
    with pytest.raises(ValueError, match=r"no entry for environment 'qevolve.environments.testing:QuietCounterEnv' "
                                         r"\(have \['declared_rooms:odd'\]\) and its class declares no"):
        penalties_for("qevolve.environments.testing:QuietCounterEnv", own)
    # expert demonstrations: expert_actions() is a source by itself; without it, the error says what to do
    jobs, dropped = get_expert_source("declared_rooms:odd")(split="test", limit=2)
    assert [job.task_id for job in jobs] == ["test-0", "test-1"] and not dropped
    assert {job.policy.source for job in jobs} == {"expert"}
    with pytest.raises(KeyError, match=r"has no expert demonstrations: implement expert_actions\(\)"):
        get_expert_source("declared_rooms:NoExpert")


def doc_thinking_snippet() -> str:
    """The doc's thought_action variant of the game (a python block that is not a file of its own)."""
    (snippet,) = [body for lang, body in doc_blocks() if lang == "python" and "rooms_thinking" in body]
    return snippet


def test_a_thought_action_expert_gives_each_step_its_thought(tmp_path, capsys, monkeypatch):
    from qevolve.environments.turn_format import parse_turn
    from qevolve.policy.bc import _check_turn_format

    site = write_game(tmp_path / "site", "thinking_rooms", "\n\n" + doc_thinking_snippet())
    monkeypatch.syspath_prepend(str(site))
    code, out, err = run_cli(["data", "expert", "thinking_rooms:rooms_thinking", "--split", "test", "--workers", "1",
                              "--output", str(tmp_path / "experts")], capsys, monkeypatch)
    assert code in (None, 0), err
    episodes = read_episodes(tmp_path / "experts")
    assert len(episodes) == 3 and all(ep.won for ep in episodes)
    first = episodes[0].turns[0]
    assert first.agent_text == f"Thought: What I need next is in the {first.action[6:]}.\nAction: {first.action}"
    assert all(parse_turn(t.agent_text, "thought_action").format_valid for ep in episodes for t in ep.turns)
    assert [t.action for t in episodes[0].turns][-1] == "open chest"
    _check_turn_format(episodes, "thought_action", "experts")  # what behaviour cloning then accepts


def test_a_thought_action_expert_without_thoughts_is_refused_before_anything_is_played(tmp_path, capsys,
                                                                                       monkeypatch):
    site = write_game(tmp_path / "site", "thoughtless_rooms", """
        @register_environment("thoughtless")
        class Thoughtless(RoomsEnv):
            turn_format = "thought_action"
        """)
    monkeypatch.syspath_prepend(str(site))
    code, out, err = run_cli(["data", "expert", "thoughtless_rooms:thoughtless", "--output", str(tmp_path / "x")],
                             capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("error: environment 'thoughtless_rooms:thoughtless': its turn_format is thought_action, "
                          "but expert_actions() for task 'train-0' gave the action 'go to kitchen' without a thought; "
                          "return (thought, action) pairs, or set turn_format = \"action\" on the class")
    assert not (tmp_path / "x").exists()  # nothing written, so a fixed game starts from scratch
    # playing the plan is still fine: env play measures the expert, it trains nothing
    code, out, err = run_cli(["env", "play", "thoughtless_rooms:thoughtless", "--split", "test", "--workers", "1"],
                             capsys, monkeypatch)
    assert code in (None, 0) and "| 3 " in out, err


def test_plan_steps_are_actions_or_thought_action_pairs():
    from qevolve.environments.play import play_jobs
    from qevolve.environments.episodes import EpisodeJob
    from qevolve.environments.policies import ReplayPolicy, split_plan

    assert split_plan(["a", ("why", "b")]) == (["a", "b"], [None, "why"])
    with pytest.raises(ValueError, match=r"expert_actions\(\) step 1: \('why', 'b', 'c'\); expected an action "
                                         r"string or a \(thought, action\) pair"):
        split_plan(["a", ("why", "b", "c")])
    with pytest.raises(ValueError, match=r"expert_actions\(\) returned str; expected a list"):
        split_plan("go north")
    # an action-format game writes a given thought's step as its action alone
    jobs = [EpisodeJob("count-2", ReplayPolicy([("one", "next"), "next"]), split="train")]
    result = play_jobs("qevolve.environments.testing:CounterEnv", jobs, split="train", num_workers=1,
                       progress=False)
    assert [t.agent_text for t in result.episodes[0].turns] == ["Action: next", "Action: next"]


def test_an_exception_in_the_users_code_in_the_main_process_names_the_environment_and_call(tmp_path, capsys,
                                                                                          monkeypatch):
    site = write_game(tmp_path, "rooms_game", """
        @register_environment("keyed")
        class Keyed(RoomsEnv):
            def __init__(self, split: str = "train"):  # accepts any split; tasks() then looks it up
                super().__init__("train")
        """)
    monkeypatch.syspath_prepend(str(site))
    code, out, err = run_cli(["env", "play", "rooms_game:keyed", "--split", "valid"], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1
    assert re.fullmatch(r"error: environment 'rooms_game:keyed': tasks\('valid'\) raised KeyError: 'valid' "
                        r"\(rooms_game.py:\d+\)\n", err), err
    # the constructor: the doc's example, from the doc's own game
    (example,) = re.findall(r"`(error: environment 'rooms_game:rooms': RoomsEnv\(split='valid'\) raised .*?)`",
                            DOC.read_text())
    code, out, err = run_cli(["env", "play", "rooms_game:rooms", "--split", "valid"], capsys, monkeypatch)
    assert code == 2 and err.strip() == example
    # without --split the default split is asked for, and the error says so
    code, out, err = run_cli(["env", "play", "rooms_game:rooms"], capsys, monkeypatch)
    assert code == 2 and "RoomsEnv(split='unseen') raised ValueError" in err
    assert err.strip().endswith("--split was not given, so the default split 'unseen' was asked for: pass "
                                "--split SPLIT")


def test_evolve_names_the_environment_not_a_split_for_a_constructor_without_split(tmp_path, monkeypatch):
    from qevolve.config import load_config
    from qevolve.evolve.loop import EvolveConfig, validate_inputs

    write_game(tmp_path / "site", "nosplit_evolve", """
        class NoSplit(RoomsEnv):
            def __init__(self, seed: int = 0):
                super().__init__()
        """)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    config = load_config(EvolveConfig, None, ["env=nosplit_evolve:NoSplit", "rollout.split=train",
                                              "critic.retrospective.enabled=false"])
    with pytest.raises(ValueError) as error:
        validate_inputs(config)
    assert str(error.value).startswith("env 'nosplit_evolve:NoSplit': NoSplit(seed=0) does not accept the keyword "
                                       "argument split=")


@pytest.mark.parametrize("command", ["eval", "rollout"])
def test_a_stage_folder_given_as_checkpoint_is_refused_before_anything_is_written(command, tiny_model_dir, tmp_path,
                                                                                 capsys, monkeypatch):
    import shutil

    stage = tmp_path / "runs" / "rooms" / "iter_1" / "policy"
    shutil.copytree(tiny_model_dir, stage / "final")
    monkeypatch.chdir(tmp_path)
    write_game(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run_cli([command, "--checkpoint", "runs/rooms/iter_1/policy", "--env", "rooms_game:rooms",
                              "--split", "test"], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1
    assert err == ("error: --checkpoint 'runs/rooms/iter_1/policy': not a saved policy (the folder holds neither "
                   "config.json nor adapter_config.json); did you mean 'runs/rooms/iter_1/policy/final'?\n")
    assert not (tmp_path / "runs" / "eval").exists() and not (tmp_path / "runs" / "rollouts").exists()


def test_the_default_eval_folder_of_a_module_environment_has_no_colon(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_game(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run_cli(["eval", "--checkpoint", str(tiny_model_dir), "--env", "rooms_game:rooms", "--split",
                              "test", "--limit", "1", "agent.max_turns=1", "agent.max_new_tokens=4",
                              "agent.num_workers=1", "prompt.max_prompt_tokens=512",
                              "prompt.reserve_action_tokens=8"], capsys, monkeypatch)
    assert code in (None, 0), err
    assert [p.name for p in (tmp_path / "runs" / "eval").iterdir()] == ["rooms_game_rooms-test"]
    metrics = json.loads((tmp_path / "runs" / "eval" / "rooms_game_rooms-test" / "metrics.json").read_text())
    # the tiny random policy does not end its turn within 4 tokens: the one turn was cut, and the user is told
    assert metrics["truncated_turn_rate"] == 1.0
    assert "WARNING: 100.0% of the 1 turns hit agent.max_new_tokens=4" in err


def test_ctrl_c_stops_env_play_without_tracebacks_from_starting_workers(tmp_path):
    """SIGINT to the whole process group (what Ctrl-C in a terminal does) while the environment workers
    start: the main process stops them and exits 130 with one line; the workers print nothing."""
    import signal
    import time

    write_game(tmp_path)
    # The CLI run from a script that, imported again as the main module of a starting worker (what the
    # spawn start method does), says so and waits: the signal then arrives during the worker's start-up.
    (tmp_path / "run_cli.py").write_text(textwrap.dedent("""
        import os, sys, time
        from pathlib import Path

        if __name__ == "__mp_main__":
            Path(f"worker-{os.getpid()}.started").touch()
            time.sleep(60)
        from qevolve.cli import main

        if __name__ == "__main__":
            main()
        """))
    import qevolve

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(qevolve.__file__).resolve().parents[1]), str(tmp_path),
                                                        os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "run_cli.py", "env", "play", "rooms_game:rooms", "--split", "train",
                                "--workers", "2"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True,
                               # as in a terminal: a test run started in the background of a non-interactive
                               # shell (CI) inherits SIGINT ignored, and Python then keeps ignoring it
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        while len(list(tmp_path.glob("worker-*.started"))) < 2 and process.poll() is None:
            time.sleep(0.05)
        assert process.poll() is None, process.communicate()
        os.killpg(process.pid, signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip() == "interrupted by SIGINT" and process.returncode == 130, (process.returncode, out, err)
