"""Environment throughput: steps per second of expert replays, 1 and 2 worker processes.

    python benchmarks/env_throughput.py sciworld [--tasks 8] [--workers 1 2]
    python benchmarks/env_throughput.py alfworld [--tasks 8] [--workers 1 2]

Each worker process builds one environment, fetches the expert plans of its share of the tasks
(untimed), waits for the others at a barrier, then replays them: resets and steps are timed
separately and throughput counts steps only. ScienceWorld runs two step paths on the same tasks:
``fast`` (the adapter: ``server.step`` + score + completed) and ``stock`` (the package's
``ScienceWorldEnv.step``, which also lists every valid action and looks around each step). ALFWorld
runs the adapter twice, in separate worker processes: ``adapter`` (TextWorld with the adapter's
shared PDDL translations and grammar parses) and ``stock`` (TextWorld exactly as shipped). The
ratio column is against ``stock`` with the same number of workers. The simulator's resident memory
(the JVM for ScienceWorld, the worker itself otherwise) is read from /proc after the replays.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from qevolve.environments.base import make_environment  # noqa: E402

SPLIT = {"sciworld": "train", "alfworld": "train"}
MODES = {"sciworld": ("fast", "stock"), "alfworld": ("adapter", "stock")}
# Modes that need a fresh process each (the ALFWorld speed-up is process-wide once applied).
SEPARATE_PROCESSES = {"alfworld"}


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def expert_plan(env, task: str) -> list[str]:
    if hasattr(env, "request_gold_path"):
        env.request_gold_path()
    env.reset(task)
    return env.expert_actions()


def replay(env, mode: str, task: str, plan: list[str]) -> tuple[int, float, float]:
    """Play ``plan`` on ``task``; return (steps, reset seconds, step seconds)."""
    stock_sciworld = mode == "stock" and env.name == "sciworld"  # the package's own step path
    t0 = time.perf_counter()
    if stock_sciworld:
        simulator = env.simulator
        name, variation = task.rsplit("/", 1)
        simulator.load(name, int(variation), env.config.simplification)
        simulator.reset()
    else:
        env.reset(task)
    t1 = time.perf_counter()
    steps = 0
    for action in plan:
        steps += 1
        if stock_sciworld:
            _, _, done, info = simulator.step(action)
            if done or info["score"] >= 100:
                break
        elif env.step(action).done:
            break
    return steps, t1 - t0, time.perf_counter() - t1


def worker(env_name: str, modes: tuple[str, ...], tasks: list[str], barrier, results) -> None:
    if env_name == "alfworld" and modes == ("stock",):
        import qevolve.environments.alfworld.env as alfworld_env

        alfworld_env._share_textworld_parses = lambda: None  # TextWorld as shipped
    env = make_environment(env_name, split=SPLIT[env_name])
    try:
        plans = [(task, expert_plan(env, task)) for task in tasks]
        for mode in modes:
            barrier.wait()
            steps = 0
            reset_s = step_s = 0.0
            for task, plan in plans:
                n, r, s = replay(env, mode, task, plan)
                steps, reset_s, step_s = steps + n, reset_s + r, step_s + s
            jvm = env.jvm_pid() if hasattr(env, "jvm_pid") else os.getpid()
            results.put((mode, os.getpid(), steps, reset_s, step_s, resident_mb(jvm)))
    finally:
        env.close()


def run(env_name: str, num_workers: int, tasks: list[str]) -> list[dict]:
    if env_name in SEPARATE_PROCESSES:
        return [row for mode in MODES[env_name] for row in run_modes(env_name, num_workers, tasks, (mode,))]
    return run_modes(env_name, num_workers, tasks, MODES[env_name])


def run_modes(env_name: str, num_workers: int, tasks: list[str], modes: tuple[str, ...]) -> list[dict]:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(num_workers), ctx.Queue()
    shares = [tasks[i::num_workers] for i in range(num_workers)]
    procs = [ctx.Process(target=worker, args=(env_name, modes, share, barrier, results)) for share in shares]
    for p in procs:
        p.start()
    rows = [results.get() for _ in range(num_workers * len(modes))]
    for p in procs:
        p.join()
    table = []
    for mode in modes:
        mine = [r for r in rows if r[0] == mode]
        steps = sum(r[2] for r in mine)
        # Workers run at the same time: the pool's rate is the sum of the workers' rates.
        rate = sum(r[2] / r[4] for r in mine if r[4] > 0)
        table.append({"mode": mode, "workers": num_workers, "steps": steps, "steps_per_s": rate,
                      "reset_s_mean": sum(r[3] for r in mine) / len(tasks),
                      "rss_mb_max": max(r[5] for r in mine)})
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("env", choices=sorted(MODES))
    parser.add_argument("--tasks", type=int, default=8, help="tasks replayed (the first N of the train split)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    env = make_environment(args.env, split=SPLIT[args.env])
    tasks = env.tasks(SPLIT[args.env])
    env.close()
    # Spread over task types: every k-th task of the split.
    stride = max(1, len(tasks) // args.tasks)
    tasks = tasks[::stride][: args.tasks]
    print(f"{args.env}: {len(tasks)} tasks, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    rows = []
    for n in args.workers:
        rows += run(args.env, n, tasks)
    base = {r["workers"]: r["steps_per_s"] for r in rows if r["mode"] == MODES[args.env][-1]}
    print("| mode | workers | steps | steps/s | x baseline | reset s (mean) | resident MiB (max) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["steps_per_s"] / base[r["workers"]] if base.get(r["workers"]) else float("nan")
        print(f"| {r['mode']} | {r['workers']} | {r['steps']} | {r['steps_per_s']:.1f} | {ratio:.1f} | "
              f"{r['reset_s_mean']:.2f} | {r['rss_mb_max']:.0f} |")


if __name__ == "__main__":
    main()
