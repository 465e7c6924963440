"""One evaluation, two generation backends: wall time, peak memory, and whether they play the same turns.

Runs ``qevolve eval`` on one policy checkpoint twice, back to back, each in its own process measured with
``/usr/bin/time -v`` where it exists: first with the vLLM backend, then with the in-process transformers
backend, with the same split, goals and overrides. Then it compares the two evaluations' trajectories
turn by turn (the generated token ids, and the log-probs of the turns both generated alike) and prints the
wall times, their ratio, each process's peak resident memory and the evaluation's own generation time
(``wall_seconds`` in metrics.json, which leaves out loading the model and starting the engine).

Made to decide ``agent.backend: auto`` on a CPU without native bf16, where the transformers backend
computes in fp32 and vLLM can too (``agent.vllm.dtype=float32``):

    python benchmarks/eval_backends.py --checkpoint RUN/bc/final --limit 25 --output /tmp/eval-backends \\
        agent.vllm.dtype=float32

``--compare-only`` skips the evaluations and compares the two folders already under ``--output``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

BACKENDS = ("vllm", "hf")


def evaluate(backend: str, args: argparse.Namespace, folder: Path) -> dict:
    """One ``qevolve eval`` in its own process; its wall time and peak RSS (from time -v where available)."""
    shutil.rmtree(folder, ignore_errors=True)
    command = [sys.executable, "-m", "qevolve.cli", "eval", "--checkpoint", args.checkpoint, "--split", args.split,
               "--output", str(folder), f"agent.backend={backend}", *args.overrides]
    if args.limit:
        command[5:5] = ["--limit", str(args.limit)]
    timer = shutil.which("time")  # GNU time, for the peak RSS; the shell's builtin is not a program
    if timer:
        command = [timer, "-v", *command]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    (folder.parent / f"{backend}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"qevolve eval with agent.backend={backend} failed (exit {done.returncode}); "
                         f"see {folder.parent / f'{backend}.log'}")
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    return {"wall_s": wall, "peak_rss_gb": int(peak.group(1)) / 1e6 if peak else None}


def metrics_of(folder: Path) -> dict:
    found = sorted(folder.rglob("metrics.json"))
    if not found:
        raise SystemExit(f"{folder}: no metrics.json (run without --compare-only first)")
    return json.loads(found[0].read_text())


def compare(first: Path, second: Path) -> dict:
    """Turn by turn: identical generated ids, and the largest log-prob difference over identical turns."""
    import numpy as np

    from qevolve.buffer.store import read_episodes

    def episodes(folder: Path) -> dict:
        files = sorted(folder.rglob("trajectories"))
        if not files:
            raise SystemExit(f"{folder}: no trajectories folder")
        return {ep.episode_id: ep for ep in read_episodes(files[0])}

    a, b = episodes(first), episodes(second)
    if set(a) != set(b):
        raise SystemExit(f"the evaluations played different episodes: {sorted(set(a) ^ set(b))[:5]}")
    same_turns = turns = same_episodes = 0
    gaps = []
    first_difference = None
    for key in sorted(a):
        turns_a, turns_b = a[key].turns, b[key].turns
        alike = len(turns_a) == len(turns_b)
        for t, (x, y) in enumerate(zip(turns_a, turns_b)):
            turns += 1
            if list(x.action_ids) == list(y.action_ids):
                same_turns += 1
                gaps.append(np.abs(np.asarray(x.action_logprobs) - np.asarray(y.action_logprobs)))
            else:
                alike = False
                first_difference = first_difference or (key, t)
                break  # the histories differ from here on
        same_episodes += alike
    gap = np.concatenate(gaps) if gaps else np.zeros(1)
    return {"episodes": len(a), "identical_episodes": same_episodes, "turns_compared": turns,
            "identical_turns": same_turns, "first_difference": first_difference,
            "max_logprob_difference": float(gap.max()), "mean_logprob_difference": float(gap.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", help="the policy folder to evaluate (e.g. RUN/bc/final)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=25, help="the first N goals (0: all)")
    parser.add_argument("--output", required=True, help="folder for the two evaluations and their logs")
    parser.add_argument("--compare-only", action="store_true", help="compare the evaluations already in --output")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for both evaluations")
    args = parser.parse_args()

    from qevolve.machine import run_environment

    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    runs = {}
    if not args.compare_only:
        if not args.checkpoint:
            raise SystemExit("--checkpoint is required unless --compare-only")
        for backend in BACKENDS:
            runs[backend] = evaluate(backend, args, output / backend)
            print(f"{backend}: {runs[backend]}", flush=True)
    environment = run_environment()
    print(f"machine: {platform.processor() or platform.machine()}, cpu {environment.get('cpu', {}).get('model')}, "
          f"torch threads {environment.get('threads', {}).get('torch')}")
    for backend in BACKENDS:
        metrics = metrics_of(output / backend)
        line = (f"{backend:5s} success {metrics.get('success_rate')}  generation {metrics.get('wall_seconds')} s  "
                f"tokens {metrics.get('tokens_generated')}")
        if backend in runs:
            line += f"  process {runs[backend]['wall_s']:.0f} s  peak RSS {runs[backend]['peak_rss_gb']} GB"
        print(line)
    if runs:
        print(f"hf / vllm wall time: {runs['hf']['wall_s'] / runs['vllm']['wall_s']:.2f}x")
    print(json.dumps(compare(output / "hf", output / "vllm")))


if __name__ == "__main__":
    main()
