"""The CLI sets OMP_WAIT_POLICY=PASSIVE before torch loads, unless the user chose a policy."""

import os
import subprocess
import sys

PROBE = ("import os, sys; import qevolve.cli; "
         "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")


def run_probe(env_value):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env_value is not None:
        env["OMP_WAIT_POLICY"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_cli_defaults_to_passive_omp_waiting_before_torch_is_imported():
    assert run_probe(None) == ["PASSIVE", "False"]


def test_cli_keeps_the_users_omp_wait_policy():
    assert run_probe("ACTIVE") == ["ACTIVE", "False"]
