"""What the tests of ``qevolve evolve`` under torch's launcher share (tests/test_evolve_distributed.py,
tests/test_evolve_multinode.py): the tiny run's config on the counter testing environment, a fault hook for
the ranks, and comparisons of runs. Its fixtures (the expert episodes, the in-process reference run) are in
conftest.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import torch

from qevolve.buffer.store import episode_record, read_episodes, sorted_episodes
from qevolve.config import load_config
from qevolve.evolve.loop import EvolveConfig
from qevolve.testing import QUIET_COUNTER, tiny_evolve_overrides

ENV = QUIET_COUNTER
WEIGHT_TOL = {"atol": 1e-5, "rtol": 1e-4}
LOGPROB_TOL = {"atol": 1e-4, "rtol": 1e-4}
TRAINING = ("bc", "iter_1/critic", "iter_1/policy", "iter_1/rft/policy")

# Faults of rank 1 in the second optimizer step of the launched stages' attempts, one per attempt in the order
# QEVOLVE_TEST_FAULTS lists them (raise: an exception; kill: SIGKILL; kill_node: SIGKILL to the process that started
# the rank's launcher, a follower node's `qevolve evolve --node-rank 1`); each leaves a file in
# QEVOLVE_TEST_FAULT_DIR when it fires. The hook is this sitecustomize on the ranks' PYTHONPATH.
FAULT_HOOK = '''
import os
faults, folder = os.environ.get("QEVOLVE_TEST_FAULTS"), os.environ.get("QEVOLVE_TEST_FAULT_DIR")
if faults and folder and os.environ.get("RANK") == "1" and len(os.listdir(folder)) < len(faults.split(",")):
    from qevolve.training.trainer import Trainer

    done = len(os.listdir(folder))
    kind, real, calls = faults.split(",")[done], Trainer.optimizer_step, [0]

    def optimizer_step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            open(os.path.join(folder, str(done)), "w").close()
            if kind == "kill":
                os.kill(os.getpid(), 9)
            if kind == "kill_node":
                import psutil

                psutil.Process(os.getppid()).parent().kill()
                return real(self, *args, **kwargs)
            raise RuntimeError("injected fault on rank 1")
        return real(self, *args, **kwargs)

    Trainer.optimizer_step = optimizer_step
'''


def install_fault_hook(tmp_path: Path, monkeypatch, faults: str) -> Path:
    """Put :data:`FAULT_HOOK` on the ranks' PYTHONPATH with ``faults`` (e.g. ``raise,kill``); returns the folder
    where each fault leaves a file when it fires."""
    hook, fired = tmp_path / "hook", tmp_path / "fired"
    hook.mkdir()
    fired.mkdir()
    (hook / "sitecustomize.py").write_text(FAULT_HOOK)
    monkeypatch.setenv("QEVOLVE_TEST_FAULTS", faults)
    monkeypatch.setenv("QEVOLVE_TEST_FAULT_DIR", str(fired))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    return fired


def tiny_config(runs_dir: Path, experts: Path, model_dir: Path, *extra: str) -> EvolveConfig:
    return load_config(EvolveConfig, None, [*tiny_evolve_overrides(runs_dir, experts, model_dir, env=ENV), *extra])


def children() -> dict[int, str]:
    """The processes this test process started, still running: pid -> command line."""
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            out[child.pid] = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            pass
    return out


def stages(root: Path) -> dict[str, dict]:
    return {stage["name"]: stage for stage in json.loads((root / "manifest.json").read_text())["stages"]}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.rglob("*.safetensors")):
        out.update({f"{path.relative_to(folder)}:{key}": value for key, value in load_file(path).items()})
    assert out, f"no weights in {folder}"
    return out


def without_logprobs(record: dict) -> tuple[dict, list[float]]:
    logprobs = [p for turn in record["turns"] for p in (turn.pop("action_logprobs", None) or [])]
    return record, logprobs


def assert_same_trajectories(a: Path, b: Path) -> None:
    left = [without_logprobs(episode_record(ep)) for ep in sorted_episodes(read_episodes(a))]
    right = [without_logprobs(episode_record(ep)) for ep in sorted_episodes(read_episodes(b))]
    assert [r for r, _ in left] == [r for r, _ in right]
    for (_, x), (_, y) in zip(left, right):
        torch.testing.assert_close(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64),
                                   **LOGPROB_TOL)


def processes_mentioning(text: str) -> dict[int, str]:
    """Every running process whose command line mentions ``text`` (a test's folder): pid -> command line.
    Finds a stopped node's launcher and ranks, which no longer descend from the test process."""
    out = {}
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if text in command:
            out[process.info["pid"]] = command
    return out


def wait_until(condition, timeout_s: float = 30.0) -> bool:
    """Whether ``condition()`` came true within ``timeout_s`` (processes that were sent a signal take a moment
    to end)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
