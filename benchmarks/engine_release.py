"""What releasing the vLLM engine before a training stage saves: an evaluation's engine, then RFT's first step.

Each case runs in its own child process (its peak RSS is its own), as ``qevolve evolve`` runs an
evaluation followed by a training stage: the quickstart's evaluation engine serves the BC policy of
a finished run (``--run``) and prefills ``--prompts`` eval-sized prompts, then the RFT stage (full
fine-tuning, built as the loop builds it) runs ``--steps`` optimizer steps. ``kept`` leaves the
engine resident, as ``qevolve evolve`` did before; ``released`` calls
:func:`qevolve.rollouts.vllm_backend.release_engine` first, as it does now. The stage functions and
their configs come from ``benchmarks/profile_quickstart.py``.

    QEVOLVE_DATA_DIR=~/qevolve-data/A PYTHONPATH=src python benchmarks/engine_release.py \\
        --run ~/qevolve-runs/A/cpu-webshop-quick --json release.json

Needs vLLM, a finished quickstart run and about 12 GB of free memory (the ``kept`` case).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import profile_quickstart as pq  # noqa: E402


def child(case: str, run: str, prompts: int, prompt_tokens: int, steps: int) -> dict:
    from qevolve.policy.bc import run_bc
    from qevolve.rollouts import vllm_backend as vb
    from qevolve.rollouts.generation import GenerationRequest, SamplingParams

    args = SimpleNamespace(config=str(pq.CONFIG), override=[], tiny=False, run=run)
    config = pq.evolve_config(args)
    with tempfile.TemporaryDirectory(prefix="engine-release-") as scratch:
        config, paths = pq.inputs(args, config, Path(scratch))
        out = {"case": case, "rss_before_mb": pq.rss_mb()}
        settings = pq.eval_rollout_config(config, paths["bc_policy"]).agent.vllm
        backend = vb.backend_for_checkpoint(paths["bc_policy"], settings, [2])
        rng = random.Random(0)
        backend.generate([GenerationRequest(k, [rng.randrange(100, 40000) for _ in range(prompt_tokens)])
                          for k in range(prompts)], SamplingParams(max_new_tokens=1))
        out["rss_engine_mb"] = pq.rss_mb()
        if case == "released":
            out["released"] = vb.release_engine()
        out["rss_before_training_mb"] = pq.rss_mb()
        cfg = pq.stage_config("rft", config, paths, Path(scratch) / "out", steps)
        run_bc(cfg, log=lambda message: None)
        out.update(peak_rss_mb=pq.peak_rss_mb(), rss_end_mb=pq.rss_mb(), kv_cache_gb=settings.cpu_kv_cache_gb,
                   steps=steps, facts=pq.environment_facts())
        return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="~/qevolve-runs/A/cpu-webshop-quick", help="a finished quickstart run")
    parser.add_argument("--cases", default="released,kept", help="comma-separated: released, kept")
    parser.add_argument("--prompts", type=int, default=8, help="eval-sized prompts the engine prefills")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=1, help="RFT optimizer steps")
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.run, args.prompts, args.prompt_tokens, args.steps)))
        return
    results = []
    for case in args.cases.split(","):
        proc = subprocess.run([sys.executable, __file__, "--child", case, "--run", args.run, "--prompts",
                               str(args.prompts), "--prompt-tokens", str(args.prompt_tokens), "--steps",
                               str(args.steps)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{case}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(result)
        print(f"{case}: RSS {result['rss_engine_mb'] / 1024:.2f} GB with the engine, "
              f"{result['rss_before_training_mb'] / 1024:.2f} GB when training starts, "
              f"peak {result['peak_rss_mb'] / 1024:.2f} GB", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
