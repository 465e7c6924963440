"""Progress: tqdm on a terminal, else one status line every N seconds; library noise silenced."""

from __future__ import annotations

import io
import warnings

import pytest

from qevolve.progress import StatusLine, progress_bar, quiet_third_party, status_interval


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_status_line_prints_one_line_per_interval_with_figures_and_eta():
    clock, out = Clock(), io.StringIO()
    bar = StatusLine(total=100, desc="bc", unit="step", interval=30.0, stream=out, clock=clock)
    for step in range(100):
        clock.now += 1.0  # one second per step
        bar.update(1)
        bar.set_postfix(loss=f"{1 / (step + 1):.4f}", tok_s="1500")
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4  # at 30, 60 and 90 s, and the final count
    assert lines[0] == "[bc] step 30/100 (30%) loss=0.0345 tok_s=1500 | 30s elapsed, ETA 1m10s"
    assert lines[-1].startswith("[bc] step 100/100 (100%)") and "ETA" not in lines[-1]
    assert "\r" not in out.getvalue()


def test_short_loops_stay_silent_and_iteration_works():
    out = io.StringIO()
    assert list(StatusLine(range(5), desc="x", interval=60.0, stream=out)) == [0, 1, 2, 3, 4]
    assert out.getvalue() == ""


def test_no_tqdm_bar_off_a_terminal(capsys):
    bar = progress_bar(total=3, desc="d", enabled=True)  # pytest's stderr is not a terminal
    assert isinstance(bar, StatusLine)
    assert isinstance(progress_bar(total=3, enabled=False), StatusLine)


def test_interval_from_the_environment(monkeypatch):
    monkeypatch.setenv("QEVOLVE_STATUS_SECONDS", "5")
    assert status_interval() == 5.0
    monkeypatch.setenv("QEVOLVE_STATUS_SECONDS", "often")
    with pytest.raises(ValueError, match=r"\$QEVOLVE_STATUS_SECONDS='often': expected a number of seconds"):
        status_interval()


def test_third_party_noise_is_silenced():
    from transformers.utils import logging as hf_logging

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_third_party(bars=False)
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
        warnings.warn("something else", FutureWarning)
    assert [str(w.message) for w in caught] == ["something else"]
    assert not hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()


def test_bc_without_progress_prints_status_lines_not_bars(tiny_model_dir, alfworld_experts, tmp_path, monkeypatch,
                                                         capsys):
    from transformers.utils import logging as hf_logging

    from qevolve.buffer.store import write_episodes
    from qevolve.policy.bc import BCConfig, run_bc

    hf_logging.enable_progress_bar()
    monkeypatch.setenv("QEVOLVE_STATUS_SECONDS", "0.000001")
    data = write_episodes(tmp_path / "experts.parquet", alfworld_experts[:2])
    config = BCConfig.model_validate({
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu", "precision": "fp32"},
        "data": {"env": "alfworld", "train_path": str(data)}, "tokens_per_batch": 2048, "grad_accum_steps": 1,
        "max_steps": 3, "output_dir": str(tmp_path / "run"), "progress": False, "tensorboard": False})
    run_bc(config, log=lambda m: None)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[bc] step")]
    assert len(lines) == 3 and "loss=" in lines[0] and "tok_s=" in lines[0] and "ETA" in lines[0]
    assert "Loading weights" not in err and "\r" not in err
    hf_logging.enable_progress_bar()
