import json

import pytest

from qevolve.evolve.run_dir import RunDirectory, RunError


def stage_writer(text, metric):
    def fn(workdir):
        (workdir / "out.txt").write_text(text)
        return {"file": "out.txt"}, {"value": metric}
    return fn


def test_stages_are_recorded_once_and_skipped_on_resume(tmp_path):
    run = RunDirectory(tmp_path / "r", {"a": 1}, seed=0)
    rec = run.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    assert rec.outputs == {"file": "bc/out.txt"}
    assert (tmp_path / "r/bc/out.txt").read_text() == "x"
    run.close()  # releases the run's lock
    with pytest.raises(RunError, match="already holds a run"):
        RunDirectory(tmp_path / "r", {"a": 1}, seed=0)
    with pytest.raises(RunError, match="started with a=1, this config has a=2"):
        RunDirectory(tmp_path / "r", {"a": 2}, seed=0, resume=True)
    # where the run lives and whether it draws progress bars compute nothing: they may change on resume
    RunDirectory(tmp_path / "r", {"a": 1, "name": "moved", "progress": False}, seed=0, resume=True).close()
    again = RunDirectory(tmp_path / "r", {"a": 1}, seed=0, resume=True)
    calls = []
    again.run_stage("bc", {}, lambda w: calls.append(1) or ({}, {}), log=lambda m: None)
    assert calls == []
    lines = (tmp_path / "r/metrics.jsonl").read_text().splitlines()
    assert [json.loads(l) for l in lines] == [{"stage": "bc", "value": 1.0}]


def test_killed_stage_leaves_nothing_and_resume_matches_uninterrupted(tmp_path):
    def killed(workdir):
        (workdir / "half.txt").write_text("partial")
        raise KeyboardInterrupt

    run = RunDirectory(tmp_path / "a", {"k": 1}, seed=0)
    run.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    with pytest.raises(KeyboardInterrupt):
        run.run_stage("iter_1/critic", {"buffer": "bc/out.txt"}, killed, log=lambda m: None)
    assert not (tmp_path / "a/iter_1/critic").exists()
    assert not list((tmp_path / "a").glob("**/.*partial*"))
    run.close()
    resumed = RunDirectory(tmp_path / "a", {"k": 1}, seed=0, resume=True)
    resumed.run_stage("iter_1/critic", {"buffer": "bc/out.txt"}, stage_writer("y", 2.0), log=lambda m: None)

    clean = RunDirectory(tmp_path / "b", {"k": 1}, seed=0)
    clean.run_stage("bc", {}, stage_writer("x", 1.0), log=lambda m: None)
    clean.run_stage("iter_1/critic", {"buffer": "bc/out.txt"}, stage_writer("y", 2.0), log=lambda m: None)
    assert (tmp_path / "a/manifest.json").read_text() == (tmp_path / "b/manifest.json").read_text()
    assert (tmp_path / "a/metrics.jsonl").read_text() == (tmp_path / "b/metrics.jsonl").read_text()


def test_resume_reads_a_field_added_since_the_run_started_as_its_default(tmp_path):
    from qevolve.evolve.loop import EvolveConfig

    def upgrade(recorded):
        return EvolveConfig.model_validate(recorded).model_dump(mode="json")

    config = EvolveConfig().model_dump(mode="json")
    RunDirectory(tmp_path / "r", config, seed=0).close()
    manifest = tmp_path / "r/manifest.json"
    old = json.loads(manifest.read_text())
    del old["config"]["bc"]["model"]["malloc_mmap_threshold_mb"]  # as written before the field existed
    manifest.write_text(json.dumps(old))
    with pytest.raises(RunError, match='malloc_mmap_threshold_mb="<missing>"'):
        RunDirectory(tmp_path / "r", config, seed=0, resume=True)  # no upgrade: a difference
    RunDirectory(tmp_path / "r", config, seed=0, resume=True, upgrade=upgrade).close()
    changed = EvolveConfig.model_validate({"bc": {"model": {"malloc_mmap_threshold_mb": 4}}}).model_dump(mode="json")
    with pytest.raises(RunError, match="bc.model.malloc_mmap_threshold_mb=null, this config has "
                                       "bc.model.malloc_mmap_threshold_mb=4"):
        RunDirectory(tmp_path / "r", changed, seed=0, resume=True, upgrade=upgrade)
