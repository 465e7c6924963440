"""benchmarks/attention_kernels.py times every candidate against the fused kernel on tiny lengths (no timing checks)."""

from __future__ import annotations


def test_every_candidate_gets_a_row_with_its_ratio_and_difference(benchmark_module):
    bench = benchmark_module("attention_kernels")
    names = [n for n in bench.ALL if n != "compiled eager"]  # one compiled candidate is enough (seconds each)
    rows = bench.measure([48, 80], names, repeats=1, chunk=32, block=32)
    assert [r["candidate"] for r in rows] == (["fp32 reference", *names]) * 2
    for row in rows:
        assert float(row["max rel diff"]) < 0.05, row  # bf16 rounding, nothing more
        if row["candidate"] == "fp32 reference":
            continue
        assert row["x fused"] > 0 and row["GFLOP/s"] > 0 and row["fwd ms"] >= 0 and row["bwd ms"] >= 0, row
        assert row["saved MB"] > 0, row
        if row["candidate"] == "fused":
            assert row["x fused"] == 1.0 and float(row["max abs diff"]) == 0.0
