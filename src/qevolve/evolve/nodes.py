"""``qevolve evolve`` over several nodes: ``distributed.nnodes`` above 1.

Node 0 is the evolve process (rollouts, evaluations, the buffer, the labels and the manifest, as with
one node); it launches every training stage with torch's static rendezvous (see
:mod:`qevolve.evolve.stage_worker`) and announces each launch in one file of the run folder,
``.stage_launch.json``, written atomically::

    {"session": "…", "launch": 3, "request": "RUN/iter_1/critic.partial/.stage_request.json", "state": "running"}

``session`` is new for every ``run_evolve`` of node 0, ``launch`` counts its launched stages,
``request`` is the stage being launched (null between stages) and ``state`` is ``running`` until
``run_evolve`` ends, then ``finished`` or ``stopped``. ``beat`` is node 0's heartbeat: a counter a thread
of node 0 advances every few seconds while its run is going. A follower waiting between stages ends with
an error when the counter has not moved for ``distributed.heartbeat_timeout_s`` by its own clock (so the
nodes' clocks need not agree): node 0 was killed (SIGKILL, a lost machine) without ending its run.
During a stage, torch's launcher notices a lost node itself.

Every other node runs a follower (:func:`follow`, ``qevolve evolve --config SAME --node-rank R``): it
resolves the same run folder from the same config, waits for node 0's launches, starts its own
launcher with ``--node_rank R`` on each request (it joins node 0's rendezvous) and ends when node 0's
run does. It writes nothing of the run's but its launcher's failure record in the stage's work folder.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from qevolve.evolve import stage_worker

LAUNCH = ".stage_launch.json"

#: how often a follower reads node 0's launch file
POLL_S = 0.5


class FollowerError(RuntimeError):
    """A follower's one-line reason to end with a non-zero exit code."""


def run_root(config: Any) -> Path:
    """The run folder node 0 and its followers share: RUNS_DIR/NAME."""
    return Path(config.runs_dir).expanduser() / config.name


class LaunchAnnouncer:
    """Node 0's side: the launch file of one ``run_evolve``, and its heartbeat every ``beat_s`` seconds."""

    def __init__(self, root: Path, beat_s: float = 20.0):
        self.path = root / LAUNCH
        self.state = {"session": uuid.uuid4().hex, "launch": 0, "request": None, "state": "running", "beat": 0}
        self._lock = threading.Lock()  # the heartbeat thread and the loop write the same file
        self._stopped = threading.Event()
        self._write()
        self._beats = threading.Thread(target=self._beat, args=(beat_s,), name="qevolve-heartbeat", daemon=True)
        self._beats.start()

    def _write(self, **changes: Any) -> None:
        from qevolve.atomic_io import write_json_atomic

        with self._lock:
            self.state.update(changes)
            write_json_atomic(self.path, self.state)

    def _beat(self, beat_s: float) -> None:
        while not self._stopped.wait(beat_s):
            self._write(beat=self.state["beat"] + 1)

    def launch(self, request: Path | None) -> None:
        """``request``: a stage is being launched (the other nodes join it); None: the launched stage ended."""
        launch = self.state["launch"] + (request is not None)
        self._write(launch=launch, request=None if request is None else str(request))

    def end(self, finished: bool) -> None:
        self._stopped.set()
        self._beats.join()
        self._write(request=None, state="finished" if finished else "stopped")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet (its atomic replace makes a partial read impossible)
        return None


def follow(config: Any, node_rank: int, log: Callable[[str], None] = print, poll_s: float = POLL_S) -> None:
    """Node ``node_rank``'s part of the run ``config`` describes: join every training stage node 0 launches,
    until node 0's run ends. Returns when it finished; raises :class:`FollowerError` (one line) when node 0's
    run stopped or a stage failed on this node."""
    settings = config.distributed
    if settings.nnodes < 2:
        raise FollowerError(f"--node-rank {node_rank} joins a run over several nodes, but distributed.nnodes is "
                            f"{settings.nnodes}")
    if not 1 <= node_rank < settings.nnodes:
        raise FollowerError(f"--node-rank {node_rank}: expected 1 to {settings.nnodes - 1} for a follower "
                            f"(distributed.nnodes={settings.nnodes}; node 0 runs without --node-rank)")
    path = run_root(config) / LAUNCH
    nproc = settings.processes()
    # A run node 0 had already ended when this follower started is an earlier one: wait for the next.
    earlier = _read(path)
    ignored = earlier["session"] if earlier and earlier["state"] != "running" else None
    session, joined = None, 0
    beat, heard = None, time.monotonic()  # node 0's last heartbeat, and when (this node's clock) it last moved
    log(f"node {node_rank} of {settings.nnodes}: waiting for node 0's training stages (announced in {path})")
    while True:
        state = _read(path)
        if state is None or state["session"] == ignored:
            time.sleep(poll_s)
            continue
        if state["session"] != session:
            session, joined = state["session"], 0
        if (state["session"], state.get("beat")) != beat:
            beat, heard = (state["session"], state.get("beat")), time.monotonic()
        if state["request"] is not None and state["launch"] > joined:
            joined = state["launch"]
            request = Path(state["request"])
            threads = json.loads(request.read_text())["threads"]
            log(f"node {node_rank}: joining launch {joined}: python -m torch.distributed.run --nnodes "
                f"{settings.nnodes} --node_rank {node_rank} --master_addr {settings.master_addr} --master_port "
                f"{settings.master_port} --nproc_per_node {nproc} -m qevolve.evolve.stage_worker run {request}")
            process = stage_worker.start_launcher(nproc, request, threads, node_rank, stdout=None)
            try:
                code = process.wait()
            except BaseException:
                stage_worker.stop_launcher(process)
                raise
            if code != 0:
                raise FollowerError(_failure(request, node_rank, code))
            log(f"node {node_rank}: launch {joined} done; waiting for the next")
            heard = time.monotonic()  # the heartbeat was not watched during the stage
            continue
        if state["state"] == "finished":
            log(f"node {node_rank}: node 0's run finished")
            return
        if state["state"] == "stopped":
            raise FollowerError("node 0's run stopped (its log names why); restart this follower with the same "
                                "command when node 0 resumes")
        silent = time.monotonic() - heard
        if state.get("beat") is not None and silent > settings.heartbeat_timeout_s:
            raise FollowerError(f"node 0 gave no sign of life for {silent:.0f} s (its heartbeat in {path} stopped at "
                                f"{state['beat']}; distributed.heartbeat_timeout_s={settings.heartbeat_timeout_s:g}): "
                                "it was killed or lost without ending its run; restart this follower with the same "
                                "command when node 0 resumes")
        time.sleep(poll_s)


def _failure(request: Path, node_rank: int, code: int) -> str:
    name = json.loads(request.read_text())["name"]
    record = _read(request.parent / stage_worker.failure_file(node_rank))
    reason = record["reason"] if record else f"its launcher exited with code {code}"
    return (f"stage {name} failed on node {node_rank}: {reason} (node 0's log names the rank that caused it); "
            "restart this follower with the same command when node 0 resumes")

