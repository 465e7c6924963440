"""A training stage of ``qevolve evolve`` in N processes: ``distributed.nproc_per_node`` above 1.

The evolve process (:func:`launch_stage`) writes what the stage needs into its work folder
(``.stage_request.json``: the run's config, the stage's name, seed, inputs and keyword options, the
run's BC policy and the thread count) and starts torch's own launcher on it::

    python -m qevolve.evolve.stage_worker launch WORKDIR/.stage_request.json
      -> torch.distributed.run --standalone --nproc_per_node N -m qevolve.evolve.stage_worker run REQUEST

Every rank rebuilds the :class:`StageContext`, seeds its generators as the evolve process does and
calls the same stage function, whose trainer (``run_bc``, ``run_policy_update``, ``train_critic``)
joins the launcher's process group; rank 0 writes the stage's outputs and metrics
(``.stage_result.json``), which the evolve process reads and records as it would an in-process
stage's. The run folder is the contract between the stages: all ranks see the same one.

A rank that raises or dies fails the stage with one line naming the stage and the rank
(:class:`StageFailedError`, from the launcher's record of the first failure: the rank's
exception as ``record`` wrote it, or the signal that ended it); the launcher stops the other
ranks, and the stage's work folder keeps its checkpoints for ``--resume``. The launcher and the
ranks end with the evolve process (``PR_SET_PDEATHSIG``), so a killed run leaves none behind.

Over several nodes (``distributed.nnodes``) each node runs this launcher with torch's static
rendezvous instead of ``--standalone`` (:func:`launcher_arguments`): node 0 from the evolve process,
the others from their followers (:mod:`qevolve.evolve.nodes`). Each node's launcher records its first
failure in a file of its own (:func:`failure_file`), and node 0 names the one that caused the stage's
end (a rank's own error before a node stopped from outside, before ranks that lost a peer).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

REQUEST = ".stage_request.json"
RESULT = ".stage_result.json"
FAILURE = ".stage_failure.json"

#: tests set this to run a training stage through the launcher even with one process, to compare that
#: path with the in-process one
LAUNCH_ONE_PROCESS = False


class StageFailedError(RuntimeError):
    """A rank of a launched training stage failed (one line: the stage, the rank and why)."""


# ------------------------------------------------------------------------------------------ the evolve process


def _encode_option(stage: str, key: str, value: Any) -> Any:
    from pydantic import BaseModel

    if isinstance(value, BaseModel):
        cls = type(value)
        encoded = {"model": f"{cls.__module__}:{cls.__qualname__}", "value": value.model_dump(mode="json")}
        if _decode_option(encoded) != value:
            raise ValueError(f"stage {stage}: option {key} does not survive its JSON form; run it with "
                             "distributed.nproc_per_node=1")
        return encoded
    if value is None or isinstance(value, (str, int, float, bool)):
        return {"value": value}
    raise ValueError(f"stage {stage}: option {key} ({type(value).__name__}) cannot be passed to a launched "
                     "stage (only settings and plain values can); run it with distributed.nproc_per_node=1")


def _decode_option(encoded: dict[str, Any]) -> Any:
    if "model" not in encoded:
        return encoded["value"]
    return _import(encoded["model"]).model_validate(encoded["value"])


def _import(qualified: str) -> Any:
    module, _, name = qualified.partition(":")
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


def stage_reference(name: str, stage: Callable[..., Any]) -> str:
    """``module:qualname`` of a stage function, checked to import back to it in another process."""
    reference = f"{stage.__module__}:{stage.__qualname__}"
    try:
        found = _import(reference) if stage.__module__ != "__main__" else None
    except (ImportError, AttributeError):
        found = None
    if found is not stage:
        raise ValueError(f"stage {name}: its function {reference} cannot be imported by the launched processes; "
                         "define it at the top level of an importable module, or run with "
                         "distributed.nproc_per_node=1")
    return reference


def _package_path() -> str:
    """The folder the qevolve package is imported from, first on the launched processes' PYTHONPATH."""
    return str(Path(__file__).resolve().parents[2])


def _die_with_parent(sig: int) -> None:
    """Linux: deliver ``sig`` to this process when its parent dies (nothing elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, sig, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def launch_stage(ctx: Any, stage: Callable[..., Any], inputs: dict[str, str], options: dict[str, Any],
                 nproc: int, threads: int,
                 announce: Callable[[Path | None], None] | None = None) -> tuple[dict[str, str], dict[str, Any]]:
    """Run ``stage(ctx, inputs, **options)`` as ``nproc`` processes under torch's launcher; returns rank 0's
    outputs and metrics. Raises :class:`StageFailedError` when a rank fails. With ``distributed.nnodes``
    above 1 this is node 0's launcher: ``announce(request)`` tells the other nodes to join the stage before
    it starts, ``announce(None)`` that it ended."""
    from qevolve.atomic_io import write_json_atomic
    from qevolve.evolve.settings import EvolveSettings

    workdir: Path = ctx.workdir
    config = ctx.config.model_dump(mode="json")
    if EvolveSettings.model_validate(config).model_dump(mode="json") != config:  # what the ranks rebuild
        raise ValueError(f"stage {ctx.name}: the run's config does not survive its JSON form; run it with "
                         "distributed.nproc_per_node=1")
    request = {
        "stage": stage_reference(ctx.name, stage), "name": ctx.name, "seed": ctx.seed, "root": str(ctx.root),
        "workdir": str(workdir), "bc_policy": ctx.bc_policy, "inputs": dict(inputs), "threads": threads,
        "config": config,
        "options": {key: _encode_option(ctx.name, key, value) for key, value in options.items()},
    }
    nnodes = ctx.config.distributed.nnodes
    for leftover in (RESULT, *failure_files(nnodes)):
        (workdir / leftover).unlink(missing_ok=True)
    write_json_atomic(workdir / REQUEST, request)
    if nnodes == 1:
        ctx.log(f"[{ctx.name}] {nproc} processes: python -m torch.distributed.run --standalone "
                f"--nproc_per_node {nproc} -m qevolve.evolve.stage_worker run {workdir / REQUEST}")
    else:
        settings = ctx.config.distributed
        ctx.log(f"[{ctx.name}] {nnodes} nodes x {nproc} processes: python -m torch.distributed.run --nnodes {nnodes} "
                f"--node_rank 0 --master_addr {settings.master_addr} --master_port {settings.master_port} "
                f"--nproc_per_node {nproc} -m qevolve.evolve.stage_worker run {workdir / REQUEST} (nodes 1 to "
                f"{nnodes - 1} join it from `qevolve evolve --node-rank R`)")
    if announce is not None:
        announce(workdir / REQUEST)
    process = start_launcher(nproc, workdir / REQUEST, threads)
    try:
        assert process.stdout is not None
        for line in process.stdout:  # rank 0's log lines (and whatever the ranks print)
            ctx.log(line.rstrip("\n"))
        code = process.wait()
    except BaseException:
        # Ctrl-C, SIGTERM: the launcher stops its ranks when it gets SIGTERM; kill it if it does not end.
        stop_launcher(process)
        raise
    finally:
        if announce is not None:
            announce(None)
    if code != 0:
        raise StageFailedError(_failure_line(ctx.name, workdir, code, nnodes))
    try:
        result = json.loads((workdir / RESULT).read_text())
    except (OSError, ValueError) as error:
        raise StageFailedError(f"stage {ctx.name}: the launched processes ended without rank 0's result "
                               f"({type(error).__name__}: {error})") from None
    for name in (REQUEST, RESULT):
        (workdir / name).unlink(missing_ok=True)
    return result["outputs"], result["metrics"]


def start_launcher(nproc: int, request: Path, threads: int, node_rank: int = 0,
                   stdout: int | None = subprocess.PIPE) -> subprocess.Popen:
    """``python -m qevolve.evolve.stage_worker launch NPROC REQUEST NODE_RANK``, with the package first on its
    PYTHONPATH and none of an enclosing launcher's rank variables."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "TORCHELASTIC_ERROR_FILE")}
    env["PYTHONPATH"] = os.pathsep.join([_package_path(), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env["PYTHONUNBUFFERED"] = "1"
    command = [sys.executable, "-m", "qevolve.evolve.stage_worker", "launch", str(nproc), str(request),
               str(node_rank)]
    return subprocess.Popen(command, env=env, stdout=stdout, text=True, bufsize=1)


def failure_file(node_rank: int) -> str:
    """The file a node's launcher records its first failure in (node 0: FAILURE)."""
    return FAILURE if node_rank == 0 else f".stage_failure.node{node_rank}.json"


def failure_files(nnodes: int) -> list[str]:
    return [failure_file(node) for node in range(nnodes)]


def stop_launcher(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


#: how long node 0 waits for the other nodes' failure records when its own names no cause (its ranks only
#: lost a peer): the other nodes' launchers write theirs once their ranks have ended, and torch's launcher
#: gives stopping ranks up to 30 s before it kills them, so the wait covers that grace and some margin
OTHER_NODES_WAIT_S = 45.0


def _read_failures(workdir: Path, nnodes: int) -> list[dict[str, Any]]:
    records = []
    for node in range(nnodes):
        try:
            records.append(json.loads((workdir / failure_file(node)).read_text()))
        except (OSError, ValueError):
            pass
    return records


def _failure_line(name: str, workdir: Path, code: int, nnodes: int = 1) -> str:
    """The stage's one line: the failure that caused it, over all nodes' records (a rank's own error before
    a node stopped from outside, before a rank that lost its peer, before a rank its launcher stopped)."""
    import time

    records = _read_failures(workdir, nnodes)
    deadline = time.monotonic() + OTHER_NODES_WAIT_S
    while (nnodes > 1 and len(records) < nnodes and not any(r.get("kind", 0) == 0 for r in records)
           and time.monotonic() < deadline):
        time.sleep(0.2)
        records = _read_failures(workdir, nnodes)
    if not records:
        return f"stage {name}: the launcher failed (exit code {code}) before any rank reported; see its output above"
    failure = min(records, key=lambda r: (r.get("kind", 0), r.get("timestamp", 0), r.get("node", 0)))
    if failure["rank"] is None:
        return f"stage {name}: node {failure.get('node', 0)} of {nnodes} failed: {failure['reason']}"
    return f"stage {name}: rank {failure['rank']} of {failure['world_size']} failed: {failure['reason']}"


# ------------------------------------------------------------------------------------------ the launcher


#: a failure record's kind, the order in which node 0 prefers them as the stage's cause
CAUSE, NODE_STOPPED, PEER_LOST, STOPPED_BY_LAUNCHER = 0, 1, 2, 3


def launcher_arguments(nproc: int, request_path: str, node_rank: int, settings: Any) -> list[str]:
    """torch.distributed.run's arguments for one node of the stage: ``--standalone`` on one node; torch's
    static rendezvous (node 0 hosts the store at master_addr:master_port and waits join_timeout_s for the
    others) on several."""
    if settings.nnodes == 1:
        nodes = ["--standalone"]
    else:
        nodes = [f"--nnodes={settings.nnodes}", f"--node_rank={node_rank}", f"--master_addr={settings.master_addr}",
                 f"--master_port={settings.master_port}", "--rdzv_backend=static",
                 f"--rdzv_conf=timeout={max(int(settings.join_timeout_s), 1)}"]
    return [*nodes, f"--nproc_per_node={nproc}", "--max_restarts=0", "--monitor_interval=0.5",
            "-m", "qevolve.evolve.stage_worker", "run", request_path]


def launch_main(nproc: int, request_path: str, node_rank: int = 0) -> int:
    """torch's launcher (``torch.distributed.run``) over this node's ranks of the stage; its first failure
    goes to the node's failure file (:func:`failure_file`)."""
    import time

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from qevolve.atomic_io import write_json_atomic
    from qevolve.evolve.settings import LaunchSettings

    _die_with_parent(signal.SIGTERM)
    workdir = Path(request_path).parent
    settings = LaunchSettings.model_validate(json.loads(Path(request_path).read_text())["config"]["distributed"])
    world_size = nproc * settings.nnodes

    def record(rank: int | None, kind: int, reason: str, exitcode: int | None = None, timestamp: float = 0) -> None:
        write_json_atomic(workdir / failure_file(node_rank),
                          {"rank": rank, "world_size": world_size, "exitcode": exitcode, "reason": reason,
                           "kind": kind, "node": node_rank, "timestamp": timestamp or int(time.time())})

    args = parse_args(launcher_arguments(nproc, request_path, node_rank, settings))
    try:
        run(args)
    except SignalException as error:  # stopped (the evolve process was interrupted): the ranks are stopped too
        if settings.nnodes > 1 and node_rank > 0:  # a node stopped from outside ends the stage on every node
            record(node_rank * nproc, NODE_STOPPED,
                   f"node {node_rank}'s launcher was stopped by {signal.Signals(int(error.sigval)).name}")
        return 128 + int(error.sigval)
    except ChildFailedError as error:
        rank, failure = first_failure(error.failures)
        kind = {0: CAUSE, 1: PEER_LOST, 2: STOPPED_BY_LAUNCHER}[_follower_kind(failure)]
        record(rank, kind, failure_reason(failure), failure.exitcode, failure.timestamp)
        return 1
    except Exception as error:  # noqa: BLE001 - the rendezvous (a node that never joined), the store, ...
        if settings.nnodes == 1:
            raise
        record(None, PEER_LOST if node_rank > 0 else CAUSE,
               f"its launcher failed before its ranks ran or after they did: {type(error).__name__}: "
               + " ".join(str(error).split())[:500])
        return 1
    return 0


#: what a rank's error says when another rank's death broke a collective (gloo, nccl): a consequence, not a cause
_PEER_LOST = re.compile(r"gloo/transport|Connection (reset|closed) by peer|DistBackendError|NCCL|ProcessGroup|"
                        r"remote process exited|Broken pipe", re.IGNORECASE)


def failure_reason(failure: Any) -> str:
    """One line on why a rank (a ``ProcessFailure``) ended: its exception as ``record`` wrote it, or its signal."""
    if failure.exitcode < 0:
        return f"killed by {failure.signal_name()} (exit code {failure.exitcode})"
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = " ".join(str(message).split())
    return message if message and "To enable traceback" not in message else f"exited with code {failure.exitcode}"


def first_failure(failures: dict[int, Any]) -> tuple[int, Any]:
    """The rank whose failure ended the stage, and its ``ProcessFailure``. The launcher's own rule is the
    earliest, but its timestamps are whole seconds, so the ranks that only followed a failure come after the
    others: those the launcher stopped (SIGTERM) and those whose collective broke because a peer died."""
    order = list(failures)
    rank = min(order, key=lambda r: (_follower_kind(failures[r]), failures[r].timestamp, order.index(r)))
    return rank, failures[rank]


def _follower_kind(failure: Any) -> int:
    """0: a cause; 1: a rank whose collective broke because a peer died; 2: a rank its launcher stopped."""
    if failure.exitcode == -int(signal.SIGTERM):
        return 2
    return 1 if failure.exitcode > 0 and _PEER_LOST.search(failure_reason(failure)) else 0


# ------------------------------------------------------------------------------------------ a rank


def run_main(request_path: str) -> None:
    """One rank: the stage as the evolve process would run it; rank 0 writes RESULT."""
    import torch

    from qevolve.atomic_io import atomic_write_text
    from qevolve.distributed import launcher_rank
    from qevolve.evolve.settings import EvolveSettings
    from qevolve.evolve.stages import StageContext
    from qevolve.seeding import seed_everything

    _die_with_parent(signal.SIGKILL)
    request = json.loads(Path(request_path).read_text())
    rank = launcher_rank()
    torch.set_num_threads(request["threads"])
    config = EvolveSettings.model_validate(request["config"])
    options = {key: _decode_option(value) for key, value in request["options"].items()}
    stage = _import(request["stage"])

    def log(line: str) -> None:
        if rank == 0:
            print(line, flush=True)

    ctx = StageContext(config=config, root=Path(request["root"]), log=log, bc_policy=request["bc_policy"],
                       name=request["name"], seed=request["seed"], workdir=Path(request["workdir"]))
    seed_everything(request["seed"])
    outputs, metrics = stage(ctx, request["inputs"], **options)
    if rank == 0:
        # in the stage's own key order (the manifest records the metrics as the stage returned them)
        atomic_write_text(Path(request["workdir"]) / RESULT,
                          json.dumps({"outputs": outputs, "metrics": metrics}, default=str))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) in (3, 4) and argv[0] == "launch":
        return launch_main(int(argv[1]), argv[2], int(argv[3]) if len(argv) == 4 else 0)
    if len(argv) == 2 and argv[0] == "run":
        from torch.distributed.elastic.multiprocessing.errors import record

        record(run_main)(argv[1])
        return 0
    print("usage: python -m qevolve.evolve.stage_worker launch NPROC REQUEST [NODE_RANK] | run REQUEST", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
