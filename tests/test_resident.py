"""A stage's own peak resident memory (Linux): reset at its start, read at its end."""

import json
import subprocess
import sys

import pytest

linux = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux's /proc/self/clear_refs and VmHWM")

# In a fresh process: in the test session's own process, what earlier tests left in the heap (and the
# allocator settings they made) decides whether a freed block goes back to the system.
PROBE = """
import json
import numpy as np
from qevolve.resident import peak_resident_bytes, reset_peak_resident

out = {"reset": reset_peak_resident(), "baseline": peak_resident_bytes()}
block = np.ones(256 * 2**20 // 8)  # 256 MiB, every page touched
out["high"] = peak_resident_bytes()
del block
out["after_free"] = peak_resident_bytes()
out["reset_again"] = reset_peak_resident()
out["after_reset"] = peak_resident_bytes()
print(json.dumps(out))
"""


@linux
def test_the_peak_is_the_stages_own_after_a_reset():
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["reset"] and out["reset_again"]
    assert out["high"] - out["baseline"] > 200 * 2**20
    assert out["after_free"] - out["baseline"] > 200 * 2**20  # a peak stays a peak after the memory is freed
    assert out["after_reset"] < out["high"] - 200 * 2**20  # the next stage starts from what is resident now
