"""A stage's own peak resident memory (Linux): reset at its start, read at its end."""

import sys

import numpy as np
import pytest

from qevolve.resident import peak_resident_bytes, reset_peak_resident

linux = pytest.mark.skipif(sys.platform != "linux", reason="needs Linux's /proc/self/clear_refs and VmHWM")


@linux
def test_the_peak_is_the_stages_own_after_a_reset():
    assert reset_peak_resident()
    baseline = peak_resident_bytes()
    block = np.ones(256 * 2**20 // 8)  # 256 MiB, every page touched
    high = peak_resident_bytes()
    assert high - baseline > 200 * 2**20
    del block
    assert peak_resident_bytes() - baseline > 200 * 2**20  # a peak stays a peak after the memory is freed
    assert reset_peak_resident()
    assert peak_resident_bytes() < high - 200 * 2**20  # the next stage starts from what is resident now
